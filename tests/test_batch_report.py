"""BatchReport without Spark: built from what the driver committed (subtasks run as plain calls), its figures
checked against what the batches did; and the driver-side check of the function's state declarations against a
restore point."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pyarrow as pa
import pytest

import keygroups as kg
from keygroups.checkpoint import CheckpointStorage
from keygroups.errors import StateMigrationError
from keygroups.runtime import KeyedProcessFunction, begin_batch, commit_batch
from keygroups.runtime.report import BatchReport, PhaseSeconds, format_time
from keygroups.runtime.driver import check_restored_states
from keygroups.runtime.subtask import run_keyed_subtask
from keygroups.serializers import Int32Serializer, Int64Serializer
from keygroups.state import ValueStateDescriptor
from keygroups.state.timers import TimeDomain

MAX_PARALLELISM = 16
OUTPUT = pa.schema([("k", pa.int64()), ("n", pa.int64())])


class Count(KeyedProcessFunction):
    def __init__(self, serializer=None):
        self.serializer = serializer or Int64Serializer()

    def open(self, context):
        self.count = context.get_state(ValueStateDescriptor("count", self.serializer))

    def process_element(self, record, context):
        n = (self.count.value() or 0) + 1
        self.count.update(n)
        if context.has_timestamp:
            context.timer_service.register_event_time_timer(context.timestamp + 1000)
        return [(context.current_key, n)]


def _batch(location, parallelism, keys, stamps, *, watermark=None, function=None, backend="heap"):
    """One batch of ``function`` (Count) over ``keys`` with event times ``stamps``; returns the committed metadata."""
    storage = CheckpointStorage(location)
    plan = begin_batch(storage, job_name="r", max_parallelism=MAX_PARALLELISM, parallelism=parallelism)
    table = pa.table({"k": pa.array(keys, pa.int64()), "t": pa.array(stamps, pa.int64())})
    spec = plan.keyed_task(key_columns=("k",), function=pickle.dumps(function or Count()), input_schema=table.schema,
                           output_schema=OUTPUT, timestamp_column="t", watermark=watermark, warm_heap_backends=0,
                           backend=backend, local_dir=location + "-local")
    owners = kg.operator_index_for_key_group(MAX_PARALLELISM, parallelism,
                                             kg.assign_key_groups(table.column("k"), MAX_PARALLELISM, "long"))
    reports = [run_keyed_subtask(spec, i, table.filter(pa.array(owners == i)).to_batches())
               for i in sorted(set(owners.tolist()))]
    reports += [run_keyed_subtask(spec, i, []) for i in plan.idle_subtasks(reports)]
    return commit_batch(plan, reports, watermark=watermark)


def test_report_of_two_batches(tmp_path):
    location = str(tmp_path / "chk")
    keys = list(range(40)) * 2
    first = BatchReport.from_checkpoint(_batch(location, 2, keys, list(range(1000, 1080)), watermark=1050))
    assert (first.records_in, first.records_late, first.records_out) == (80, 0, 80)
    assert (first.watermark_before, first.watermark_after) == (None, 1050)
    assert (first.event_time_min, first.event_time_max) == (1000, 1079)
    assert first.parallelism_reason == "fixed" and first.parallelism == 2
    assert (first.key_groups_warm, first.key_groups_caught_up, first.key_groups_cold) == (0, 0, 0)
    assert first.timers_registered == 80 and first.timers_fired == 0 and first.timers_pending == 80
    assert first.state_entries == 80   # per key its count and its timers (a map in the hidden timer state)
    assert 0 < first.state_bytes <= first.bytes_written   # the file also has its header

    # the second batch: 10 records at or before the watermark are late, timers up to 2100 fire, restored cold at p=4
    stamps = [1040 + i for i in range(10)] + [2000 + i for i in range(30)]
    second = BatchReport.from_checkpoint(_batch(location, 4, list(range(40)), stamps, watermark=2100))
    assert (second.records_in, second.records_late) == (40, 10)
    assert second.records_out == 30   # on_timer emits nothing
    assert (second.watermark_before, second.watermark_after) == (1050, 2100)
    assert (second.event_time_min, second.event_time_max) == (1040, 2029)   # the late records count in the range
    assert second.key_groups_cold == MAX_PARALLELISM and second.bytes_restored > 0
    assert second.timers_fired == 80 and second.timers_pending == 30   # the first batch's (2000-2079) fire
    assert second.late_share == pytest.approx(0.25)
    assert second.seconds.restore > 0 and second.seconds.process > 0 and second.seconds.snapshot > 0
    line = second.summary()
    assert "10 late (25%)" in line and "p=4 (fixed)" in line and f"cold {MAX_PARALLELISM}" in line
    assert str(second) == line


def test_report_of_a_committed_policy_decision(tmp_path):
    location = str(tmp_path / "chk")
    metadata = _batch(location, 1, [1, 2], [5, 6])
    metadata.properties["parallelism_policy"] = {"policy": "RecordsPerSubtask(10)", "records": 2, "chose": 1}
    metadata.properties["driver_seconds"] = {"plan": 0.25}
    report = BatchReport.from_checkpoint(metadata, commit_seconds=0.5)
    assert report.parallelism_reason == "RecordsPerSubtask(10) chose 1 for 2 records"
    assert report.seconds == PhaseSeconds(plan=0.25, restore=report.seconds.restore,
                                          process=report.seconds.process, snapshot=report.seconds.snapshot,
                                          commit=0.5)
    assert report.total_seconds == pytest.approx(sum(report.to_dict()["seconds"].values()))


def test_format_time():
    assert format_time(None) == "none"
    assert format_time(1_767_225_600_000) == "2026-01-01T00:00:00.000+00:00"
    assert "outside the calendar" in format_time(2 ** 62)


def test_restored_states_are_checked_against_the_function_on_the_driver(tmp_path):
    location = str(tmp_path / "chk")
    metadata = _batch(location, 2, list(range(10)), list(range(10)))
    same = dict(key_type="long", job_name="r", max_parallelism=MAX_PARALLELISM, allow_pickle=False,
                checkpoint_id=2)
    check_restored_states(pickle.dumps(Count()), metadata, **same)   # unchanged: accepted
    with pytest.raises(StateMigrationError, match="For state 'count', the new value serializer .* cannot read"):
        check_restored_states(pickle.dumps(Count(Int32Serializer())), metadata, **same)
    with pytest.raises(StateMigrationError, match="key"):   # the key changed type: int instead of long
        check_restored_states(pickle.dumps(Count()), metadata, **{**same, "key_type": "string"})


class OpensOnlyOnExecutors(Count):
    def open(self, context):
        raise RuntimeError("needs an executor")


def test_a_function_whose_open_fails_on_the_driver_is_left_to_the_tasks(tmp_path):
    metadata = _batch(str(tmp_path / "chk"), 1, [1], [1])
    check_restored_states(pickle.dumps(OpensOnlyOnExecutors()), metadata, key_type="long", job_name="r",
                          max_parallelism=MAX_PARALLELISM, allow_pickle=False, checkpoint_id=2)


def test_estimated_entries_grow_with_the_keys_not_the_batches(tmp_path):
    location = str(tmp_path / "chk")
    for i in range(3):
        _batch(location, 1, list(range(50)), list(np.arange(50) + 100 * i))
    report = BatchReport.from_checkpoint(CheckpointStorage(location).latest())
    assert report.state_entries == 100   # per key its count and its timers, though restored from three blocks


def test_rocksdb_reports_its_own_estimate(tmp_path):
    location = str(tmp_path / "chk")
    for i in range(2):
        metadata = _batch(location, 2, list(range(300)), list(range(300)), backend="rocksdb")
    report = BatchReport.from_checkpoint(metadata)
    assert report.key_groups_warm + report.key_groups_caught_up + report.key_groups_cold == MAX_PARALLELISM
    assert report.state_entries is not None and 300 <= report.state_entries <= 1200   # counts and timer maps


class MovesItsTimer(KeyedProcessFunction):
    """One event-time timer per key, moved to the latest record's time + 1000: the earlier one is deleted (its queue
    entry stays until it comes up, so the queue holds more entries than there are timers)."""

    def open(self, context):
        self.at = context.get_state(ValueStateDescriptor("at", Int64Serializer()))

    def process_element(self, record, context):
        timers = context.timer_service
        if self.at.value() is not None:
            timers.delete_event_time_timer(self.at.value())
        self.at.update(context.timestamp + 1000)
        timers.register_event_time_timer(context.timestamp + 1000)
        return [(context.current_key, 1)]


def test_timers_pending_are_the_timers_the_checkpoint_holds(tmp_path):
    """``timers_pending`` counts registered timers, not queue entries: deleted timers' entries stay queued in a
    warm backend, and once overstated the figure (1,626 for a checkpoint of 597)."""
    from keygroups.runtime.state_reader import read_timers
    from keygroups.runtime.subtask_state import HeapBackendRegistry
    from keygroups.state.timers import TimerQueueRegistry

    location = str(tmp_path / "chk")
    storage = CheckpointStorage(location)
    kept, kept_timers = HeapBackendRegistry(), TimerQueueRegistry()
    pending = []
    for batch in range(4):
        plan = begin_batch(storage, job_name="r", max_parallelism=MAX_PARALLELISM, parallelism=1)
        keys = list(range(30)) * 3
        table = pa.table({"k": pa.array(keys, pa.int64()),
                          "t": pa.array([10_000 * batch + i for i in range(len(keys))], pa.int64())})
        spec = plan.keyed_task(key_columns=("k",), function=pickle.dumps(MovesItsTimer()), input_schema=table.schema,
                               output_schema=OUTPUT, timestamp_column="t", watermark=10_000 * batch + 30)
        report = run_keyed_subtask(spec, 0, table.to_batches(), warm=kept, warm_timers=kept_timers)
        metadata = commit_batch(plan, [report], watermark=10_000 * batch + 30)
        assert report.timers[TimeDomain.EVENT_TIME].queued > 30   # stale entries of the moved timers
        got = BatchReport.from_checkpoint(metadata)
        pending.append(got.timers_pending)
        assert got.timers_pending == read_timers(storage, metadata).num_rows
    assert pending == [30, 30, 30, 30]


def test_the_report_says_which_ranges_the_batch_ran_with_and_why(tmp_path):
    from keygroups._ranges import operator_indexes_for_boundaries
    from keygroups.runtime import AssignmentDecision, BalancedRanges

    location = str(tmp_path / "chk")
    storage = CheckpointStorage(location)
    for keys in ([1] * 200 + list(range(100)), [1] * 200 + list(range(100))):
        plan = begin_batch(storage, job_name="r", max_parallelism=MAX_PARALLELISM, parallelism=2,
                           assignment=BalancedRanges())
        table = pa.table({"k": pa.array(keys, pa.int64()), "t": pa.array(range(len(keys)), pa.int64())})
        spec = plan.keyed_task(key_columns=("k",), function=pickle.dumps(Count()), input_schema=table.schema,
                               output_schema=OUTPUT, warm_heap_backends=0)
        owners = operator_indexes_for_boundaries(plan.boundaries, kg.assign_key_groups(table.column("k"),
                                                                                         MAX_PARALLELISM, "long"))
        metadata = commit_batch(plan, [run_keyed_subtask(spec, i, table.filter(pa.array(owners == i)).to_batches())
                                       for i in range(2)])
    report = BatchReport.from_checkpoint(metadata)
    assert isinstance(report.assignment, AssignmentDecision)
    decided, got = plan.assignment, report.assignment   # the very decision the driver took, read back
    assert (got.boundaries, got.previous, got.moved, got.reason, got.moved_key_groups, got.hot_key_groups) == (
        decided.boundaries, decided.previous, decided.moved, decided.reason, decided.moved_key_groups,
        [dataclasses.replace(h, share=round(h.share, 6), times_mean=round(h.times_mean, 4))
         for h in decided.hot_key_groups])
    assert got.max_over_mean == pytest.approx(decided.max_over_mean, abs=1e-4)
    assert got.flink_max_over_mean == pytest.approx(decided.flink_max_over_mean, abs=1e-4)
    assert report.assignment.assignment == "balanced" and report.assignment.boundaries == plan.boundaries
    assert f"; ranges balanced: {plan.assignment.reason}; load max/mean" in report.summary()
    first = BatchReport.from_checkpoint(storage.load(1))
    assert first.assignment is not None and first.assignment.previous is None


def _walked_state_bytes(metadata):
    """Each key group's chain bytes, walked over every handle of ``metadata`` (what the report must equal)."""
    from keygroups._ranges import KeyGroupRange
    from keygroups.checkpoint import chain_stats

    state = np.zeros(metadata.max_parallelism)
    if metadata.keyed_handles:
        for group, chain in chain_stats(metadata, KeyGroupRange(0, metadata.max_parallelism - 1)).items():
            state[group] = chain.full_bytes + chain.delta_bytes
    return state


def test_state_bytes_worked_out_from_what_the_batch_wrote_equal_every_chain_walked():
    """The spine works a committed checkpoint's state bytes out from the restore point's and the blocks the batch
    wrote; over batches whose chains grow, get materialized (full blocks again) and whose balanced ranges move,
    they equal a walk over every key group's chain."""
    import random

    from keygroups.runtime.assignment import BalancedRanges, key_group_state_bytes
    from keygroups.testing import KeyedFunctionHarness

    rng = random.Random(32)
    with KeyedFunctionHarness(Count(), "k", output_schema=OUTPUT, max_parallelism=32, parallelism=3,
                              assignment=BalancedRanges(evidence=1, caution=0)) as h:
        materialized = moved = 0
        boundaries = None
        for i in range(40):
            hot = (i // 8) * 37   # the skew stays for 8 batches, then moves: the balanced ranges follow it
            keys = [hot] * 300 + [rng.randrange(1000) for _ in range(rng.randrange(0, 40))]
            batch = h.process(pa.table({"k": pa.array(keys, pa.int64())}))
            metadata = batch.metadata
            walked = _walked_state_bytes(metadata)
            assert np.array_equal(key_group_state_bytes(metadata), walked), i
            assert batch.report.state_bytes == int(walked.sum()) > 0
            new = [hd for hd in metadata.keyed_handles if hd.checkpoint_id == metadata.checkpoint_id]
            materialized += i > 0 and any(hd.changed_key_groups()[0] for hd in new)
            moved += boundaries is not None and batch.report.assignment.boundaries != boundaries
            boundaries = batch.report.assignment.boundaries
        assert materialized and moved   # both ways a chain changes were exercised
