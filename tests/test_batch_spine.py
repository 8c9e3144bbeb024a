"""The batch spine (keygroups.runtime.batch) that KeyedJob and the test harness both run: a change in it reaches both;
a batch plans once, locates its restore point from what the driver committed (no listing, no ``_metadata`` read
again), ships that ``_metadata`` to its tasks (which never read it from the storage); typed reports survive JSON;
the properties codec reads what older checkpoints stored."""

from __future__ import annotations

import pickle
import sys
import threading

import pyarrow as pa
import pytest

import keygroups as kg

from keygroups.checkpoint import CheckpointStorage
from keygroups.errors import CorruptSnapshotError
from keygroups.runtime import RecordsPerSubtask
from keygroups.runtime import batch as spine
from keygroups.runtime.assignment import FlinkRanges
from keygroups.runtime.batch import JobDriver, JobOptions
from keygroups.runtime.local import LocalExecutor
from keygroups.runtime.properties import PROPERTIES_VERSION, BatchProperties
from keygroups.runtime.report import RestoreInfo, SourceReport, SplitPosition, SubtaskReport, TimerFigures
from keygroups.state.timers import TimeDomain
from keygroups.testing import KeyedFunctionHarness
from spark_functions import KEY_TOTALS as OUT, Total


def _marking_commit(monkeypatch, seen):
    """The spine's commit, changed: every checkpoint it commits carries a marker property."""
    commit = spine.commit_batch

    def marked(plan, *args, **kwargs):
        seen.append(plan.checkpoint_id)
        kwargs["properties"] = {**(kwargs.get("properties") or {}), "spine": "changed"}
        return commit(plan, *args, **kwargs)

    monkeypatch.setattr(spine, "commit_batch", marked)


def test_a_change_in_the_spine_reaches_the_harness(monkeypatch):
    seen: list[int] = []
    _marking_commit(monkeypatch, seen)
    with KeyedFunctionHarness(Total(), "k", output_schema=OUT, parallelism=2, max_parallelism=16) as h:
        batch = h.process([{"k": 1, "v": 2}, {"k": 2, "v": 3}])
        assert batch.metadata.properties["spine"] == "changed" and seen == [1]
        assert BatchProperties.of(batch.metadata).extra == {"spine": "changed"}


@pytest.mark.spark
def test_a_change_in_the_spine_reaches_keyed_job(spark, tmp_path, monkeypatch):
    from pyspark import cloudpickle

    from keygroups.spark import KeyedJob

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    seen: list[int] = []
    _marking_commit(monkeypatch, seen)
    job = KeyedJob("spine", "k", Total(), output_schema=OUT, max_parallelism=16,
                   checkpoint_location=str(tmp_path / "chk"))
    result = job.run_batch(spark.createDataFrame([(1, 2), (2, 3)], "k long, v long"), parallelism=2)
    assert result.metadata.properties["spine"] == "changed" and seen == [1]
    assert result.report.spark_seconds is not None and 0 < result.report.spark_seconds <= result.report.wall_seconds
    assert sorted(map(tuple, result.output.collect())) == [(1, 2), (2, 3)]


def _driver(tmp_path, **options):
    storage = CheckpointStorage(str(tmp_path / "chk"))
    return JobDriver(JobOptions(name="j", key_columns=("k",), function=pickle.dumps(Total()), output_schema=OUT,
                                max_parallelism=32, **options), storage, fence=False), storage


def _table(keys, v=1):
    return pa.table({"k": pa.array(keys, pa.int64()), "v": pa.array([v] * len(keys), pa.int64())})


class Counting:
    """Counts the driver thread's calls of some storage methods (retention runs in a thread of its own)."""

    def __init__(self, monkeypatch, *names):
        self.calls = {n: 0 for n in names}
        main = threading.get_ident()
        for name in names:
            original = getattr(CheckpointStorage, name)

            def counted(storage, *args, _name=name, _original=original, **kwargs):
                if threading.get_ident() == main:
                    self.calls[_name] += 1
                return _original(storage, *args, **kwargs)

            monkeypatch.setattr(CheckpointStorage, name, counted)


def test_a_batch_plans_once_and_reads_nothing_it_committed_itself(tmp_path, monkeypatch):
    driver, storage = _driver(tmp_path)
    driver.run(LocalExecutor(_table(range(100))), parallelism=2)
    choices = []
    choose = FlinkRanges.choose

    def counted_choose(self, *args, **kwargs):
        choices.append(args[2])
        return choose(self, *args, **kwargs)

    monkeypatch.setattr(FlinkRanges, "choose", counted_choose)
    counting = Counting(monkeypatch, "checkpoint_ids", "load", "load_restore_point", "latest", "_read_metadata")
    batch = driver.run(LocalExecutor(_table(range(100))), parallelism=RecordsPerSubtask(25))
    assert choices == [4] and batch.plan.parallelism == 4          # a policy batch plans once, at its parallelism
    assert counting.calls == dict.fromkeys(counting.calls, 0)      # no listing, no _metadata read: not by the
    report = batch.report                                          # driver, nor by the tasks (same thread here)
    # both old ranges' backends are kept in this process: split into the new ranges, nothing is read
    assert report.key_groups_warm == 32 and report.bytes_restored == 0
    driver.wait_for_retention()
    assert storage.checkpoint_ids() == [1, 2]


def test_the_tasks_restore_from_the_metadata_the_spec_ships(tmp_path, monkeypatch):
    driver, storage = _driver(tmp_path, warm_heap_backends=0)
    driver.run(LocalExecutor(_table(range(50))), parallelism=2)

    def refused(*args, **kwargs):
        raise AssertionError("a task read _metadata from the storage")

    monkeypatch.setattr(CheckpointStorage, "load_restore_point", refused)
    batch = driver.run(LocalExecutor(_table(range(50), v=2)), parallelism=3)
    assert batch.report.key_groups_cold == 32 and batch.report.records_out == 50


def test_a_compact_spec_ships_the_same_restore_point_compressed(tmp_path, monkeypatch):
    """What the Spark executor ships (``KeyedTaskSpec.compact``): the restore point's ``_metadata`` compressed, from
    which a task restores exactly what the plain spec restores, without reading the storage; a corrupt frame is a
    CorruptSnapshotError."""
    import dataclasses

    from keygroups.runtime import begin_batch
    from keygroups.runtime.subtask import run_keyed_subtask

    driver, storage = _driver(tmp_path, warm_heap_backends=0)
    for v in (1, 2, 3):
        driver.run(LocalExecutor(_table(range(200), v=v)), parallelism=2)
    plan = begin_batch(storage, job_name="j", max_parallelism=32, parallelism=2)
    table = _table([5], v=10)
    spec = plan.keyed_task(key_columns=("k",), function=pickle.dumps(Total()), input_schema=table.schema,
                           output_schema=OUT, warm_heap_backends=0, local_dir=str(tmp_path / "local"))
    packed = spec.compact()
    assert packed.restore_metadata_size == len(spec.restore_metadata) > len(packed.restore_metadata)
    assert packed.compact() is packed and packed.own_key_groups(1) == spec.own_key_groups(1)
    assert packed.shipped_restore_point().keyed_handles == spec.shipped_restore_point().keyed_handles

    def refused(*args, **kwargs):
        raise AssertionError("a task read _metadata from the storage")

    monkeypatch.setattr(CheckpointStorage, "load_restore_point", refused)
    group = int(kg.assign_key_groups(table.column("k"), 32, "long")[0])
    subtask = next(i for i in range(2) if group in packed.own_key_groups(i))
    plain, compact = (run_keyed_subtask(s, subtask, table.to_batches()) for s in (spec, packed))
    assert compact.records_out == plain.records_out == 1 and compact.restored.mode == plain.restored.mode == "cold"
    torn = dataclasses.replace(packed, restore_metadata=packed.restore_metadata[:-7])
    with pytest.raises(CorruptSnapshotError, match="does not decompress"):
        torn.shipped_restore_point()


def test_another_writer_makes_the_driver_list_again(tmp_path):
    driver, storage = _driver(tmp_path)
    driver.run(LocalExecutor(_table(range(10))), parallelism=1)
    other, _ = _driver(tmp_path)
    other.run(LocalExecutor(_table(range(10))), parallelism=1)   # checkpoint 2, behind the first driver's back
    from keygroups.errors import ConcurrentCommitError

    with pytest.raises(ConcurrentCommitError):
        driver.run(LocalExecutor(_table(range(10))), parallelism=1)   # planned from 1: refused by the commit
    batch = driver.run(LocalExecutor(_table(range(10))), parallelism=1)   # listed again: from 2
    assert batch.checkpoint_id == 3 and batch.report.records_out == 10


def test_subtask_reports_cross_json_whole():
    report = SubtaskReport(
        subtask=1, key_group_range=__import__("keygroups").KeyGroupRange(4, 7), output_file="chk-3/output-1.parquet",
        restored=RestoreInfo.cold(__import__("keygroups").KeyGroupRange(4, 7), 120, 4), records_in=5,
        records_late=1, records_out=4, max_event_time=99, event_time_range=(10, 99),
        timers={TimeDomain.EVENT_TIME: TimerFigures(2, 1, 3, 5, 40, True)}, snapshot_bytes=77, state_entries=9,
        key_group_records="abc")
    assert SubtaskReport.from_json(report.to_json()) == report
    stored = SubtaskReport.from_json(report.stored())
    assert stored.keyed_handle is None and stored.key_group_records is None and stored.records_out == 4
    with pytest.raises(CorruptSnapshotError, match="a subtask report is malformed .*records_in"):
        SubtaskReport.from_json({**report.to_json(), "records_in": "5"})


def test_source_reports_cross_json_whole_in_the_form_a_checkpoint_stores():
    """A log's and Kafka's source reports, typed, through a task's JSON and a checkpoint's properties: stored as each
    reader reported it (Kafka's driver reads its positions back from there); a malformed one is refused."""
    log = SourceReport(subtask=0, operator_handle=None, input_file="chk-2/input-0.parquet", records=3,
                       partitions=((None, 0), (None, 2)),
                       positions=(SplitPosition(None, 0, 40), SplitPosition(None, 2, 9)))
    assert log.stored()["partitions"] == [0, 2] and log.stored()["positions"] == {"0": 40, "2": 9}
    kafka = SourceReport(subtask=1, operator_handle=None, input_file=None, records=0, partitions=(("t", 1),),
                         positions=(SplitPosition("t", 1, 6),), records_skipped=1,
                         notes={"skipped": ({"topic": "t", "partition": 1, "offset": 3},)})
    assert kafka.stored()["positions"] == [["t", 1, 6]] and kafka.offsets() == {("t", 1): 6}
    for report in (log, kafka):
        assert SourceReport.from_json(report.to_json()) == report
        assert SourceReport.from_json(report.stored()) == report
    stored = BatchProperties(source_reports=(log, kafka)).encode()
    assert BatchProperties.decode(stored).source_reports == (log, kafka)
    with pytest.raises(CorruptSnapshotError, match="a source report is malformed"):
        SourceReport.from_json({**kafka.to_json(), "positions": [["t", 1]]})


def test_properties_of_a_checkpoint_written_before_the_codec_still_read():
    """Version 1 (no version key): reports with and without per key group restore runs, timers without
    ``pending``; unknown keys are the caller's own."""
    old = {"watermark": 5, "processing_time": 7, "records_late": 1, "start_watermark": 2,
           "timers": {"event-time": {"queued": 4, "registered": 1, "fired": 0, "earliest": 3}},
           "reports": [{"subtask": 0, "key_group_range": [0, 7], "output_file": "chk-1/o.parquet",
                        "records_in": 3, "records_out": 2, "restored": {"mode": "cold", "bytes_read": 9,
                                                                       "key_groups": 8, "warm": False},
                        "seconds": {"restore": 0.1, "process": 0.2}}],
           "driver_seconds": {"plan": 0.5}, "input_digest": {"records": 3, "xxhash64_sum": 11}, "mine": [1]}
    props = BatchProperties.decode(old, checkpoint_id=1)
    assert props.version == 1 and props.watermark == 5 and props.extra == {"mine": [1]}
    assert props.timers[TimeDomain.EVENT_TIME].pending is None
    (report,) = props.reports
    assert report.restored.warm_key_groups is None and report.key_groups_by_mode == {"warm": 0, "caught-up": 0,
                                                                                      "cold": 8}
    again = BatchProperties.decode(props.encode(), checkpoint_id=1)
    assert again.version == PROPERTIES_VERSION and again.reports == props.reports and again.extra == {"mine": [1]}
    with pytest.raises(CorruptSnapshotError, match=r"checkpoint 1: its properties are of version 9"):
        BatchProperties.decode({"properties_version": 9}, checkpoint_id=1)
    with pytest.raises(CorruptSnapshotError, match=r"checkpoint 1: properties\['watermark'\]"):
        BatchProperties.decode({"watermark": "soon"}, checkpoint_id=1)


def test_keygroups_own_properties_are_refused_from_the_caller(tmp_path):
    driver, _ = _driver(tmp_path)
    with pytest.raises(ValueError, match=r"properties \['watermark'\] are keygroups' own"):
        driver.run(LocalExecutor(_table([1])), parallelism=1, properties={"watermark": 3})
