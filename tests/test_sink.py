"""In-task sinks with a two-phase commit (keygroups.runtime.sink, keygroups.sinks), on the Spark-free spine: the
local executor runs the same subtask code a Spark task runs, and the driver the same JobDriver as KeyedJob.

What a reader of the sink's directory sees is checked against a plain model of the committed batches: exactly the
output rows, each once, whatever failed in between (a task after its writer staged output, a lost compare-and-swap,
a driver that died between the checkpoint's commit and the sink's, a rescale)."""

from __future__ import annotations

import json
import os
import pickle
from collections import Counter

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keygroups._ranges import KeyGroupRange
from keygroups.checkpoint import CheckpointStorage
from keygroups.errors import ConcurrentCommitError, KeyGroupsError
from keygroups.runtime.batch import JobDriver, JobOptions
from keygroups.runtime.local import LocalExecutor
from keygroups.runtime.properties import BatchProperties, StreamingBatch
from keygroups.runtime.report import RestoreInfo, SubtaskReport
from keygroups.runtime.sink import MAX_COMMITTABLE_BYTES, SinkCommitError, SinkCommittable, SinkContext, TaskSink
from keygroups.sinks import CountingSink, ParquetSink, Sink, SinkWriter, TaskFunctionSink
from keygroups.sinks.parquet import STAGING, _job_dir
from keygroups.testing import KeyedFunctionHarness
from spark_functions import KEY_TOTALS as OUT, Total


class FailsAtSnapshot(Total):
    """Fails after the sink staged and pre-committed its output: while the subtask snapshots (raw keyed state)."""

    def snapshot_raw_keyed_state(self, out):
        raise RuntimeError("disk full while snapshotting")


class Crash(BaseException):
    """The driver process dying: not an error the driver handles."""


class CrashingParquetSink(ParquetSink):
    """A ParquetSink whose driver dies when it is asked to commit a checkpoint after ``after`` (nothing of the commit
    happens); it commits earlier ones (what a new driver commits again first)."""

    def __init__(self, path, after):
        super().__init__(path)
        self.after = after

    def commit(self, checkpoint_id, committables):
        if checkpoint_id > self.after:
            raise Crash(f"driver died before publishing checkpoint {checkpoint_id}")
        super().commit(checkpoint_id, committables)


def _dying(root, out):
    """A new driver that dies between its first batch's checkpoint commit and its sink commit."""
    ids = CheckpointStorage(str(root / "chk")).checkpoint_ids()
    return _driver(root, CrashingParquetSink(str(out), ids[-1] if ids else -1))


class FlakyParquetSink(ParquetSink):
    """A ParquetSink whose commit fails ``failures`` times (an object store refusing for a while)."""

    def __init__(self, path, failures):
        super().__init__(path)
        self.failures = failures

    def commit(self, checkpoint_id, committables):
        if self.failures:
            self.failures -= 1
            raise OSError("503 Slow Down")
        super().commit(checkpoint_id, committables)


def _table(keys, v=1):
    return pa.table({"k": pa.array(keys, pa.int64()), "v": pa.array([v] * len(keys), pa.int64())})


def _driver(tmp_path, sink, function=None, **options):
    storage = CheckpointStorage(str(tmp_path / "chk"))
    return JobDriver(JobOptions(name="j", key_columns=("k",), function=pickle.dumps(function or Total()),
                                output_schema=OUT, max_parallelism=32, sink=sink, **options),
                     storage, fence=False, background_retention=False)


def _visible(path) -> Counter:
    """The rows a reader of the sink's directory sees (Arrow's dataset reader: it skips ``_staging``)."""
    if not os.path.isdir(path) or not [n for n in os.listdir(path) if n.endswith(".parquet")]:
        return Counter()
    return Counter(map(tuple, (tuple(r.values()) for r in pq.read_table(str(path)).to_pylist())))


def _staged(path) -> list[str]:
    root = os.path.join(path, STAGING)
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


class Model:
    """What a reader must see after the committed batches: each key's running totals, each once."""

    def __init__(self):
        self.totals: dict[int, int] = {}
        self.rows: Counter = Counter()

    def commit(self, keys, v=1):
        for k in keys:
            self.totals[k] = self.totals.get(k, 0) + v
            self.rows[(k, self.totals[k])] += 1


def test_exactly_the_output_rows_reach_the_parquet_sink_across_rescales(tmp_path):
    out = tmp_path / "out"
    sink = ParquetSink(str(out))
    driver = _driver(tmp_path, sink)
    model = Model()
    for i, (p, keys) in enumerate([(2, range(100)), (4, range(50, 130)), (1, range(0, 200, 3)), (3, [7] * 5)]):
        batch = driver.run(LocalExecutor(_table(list(keys), v=i + 1)), parallelism=p)
        model.commit(keys, v=i + 1)
        assert _visible(out) == model.rows
        assert batch.metadata.outputs == []   # the output went to the sink only
        assert all(r.output_file is None for r in batch.reports)
    assert _staged(out) == []
    names = sink.committed_files()
    assert all(n.startswith("part-") and n.endswith(".parquet") for n in names)
    # one file per subtask with output, named by checkpoint then subtask
    assert [n.split("-")[1:3] for n in names] == sorted(n.split("-")[1:3] for n in names)
    assert {int(n.split("-")[1]) for n in names} == {1, 2, 3, 4}
    assert sum(1 for n in names if int(n.split("-")[1]) == 4) == 1   # one key: one subtask had output


def test_committables_are_stored_with_the_checkpoint(tmp_path):
    sink = ParquetSink(str(tmp_path / "out"))
    driver = _driver(tmp_path, sink)
    batch = driver.run(LocalExecutor(_table(range(40))), parallelism=2)
    stored = BatchProperties.of(driver.storage.load(batch.checkpoint_id)).reports
    committables = [r.sink_committable for r in stored]
    assert all(c is not None and c.sink == "keygroups.parquet" for c in committables)
    assert sorted(c.subtask for c in committables) == [0, 1]
    assert sum(c.data["rows"] for c in committables) == 40
    assert {c.data["file"] for c in committables} == set(sink.committed_files())


def test_the_driver_side_kafka_sink_refuses_a_checkpoint_whose_output_went_to_an_in_task_sink(tmp_path):
    pytest.importorskip("confluent_kafka")
    from keygroups.sources import KafkaSink
    from keygroups.sources.kafka_sink import KafkaSinkError

    driver = _driver(tmp_path, ParquetSink(str(tmp_path / "out")))
    batch = driver.run(LocalExecutor(_table(range(10))), parallelism=2)
    # refused before it asks any broker (none listens on this port): nothing is produced, no progress recorded
    kafka = KafkaSink("t", key_columns="k", bootstrap_servers="127.0.0.1:9")
    with pytest.raises(KafkaSinkError, match=r"holds no output files: its output went to .*'keygroups\.parquet'.* "
                                             r"checkpoint_output=True"):
        kafka.deliver(driver.storage, batch.metadata)


def test_checkpoint_output_keeps_both(tmp_path):
    out = tmp_path / "out"
    driver = _driver(tmp_path, ParquetSink(str(out)), checkpoint_output=True)
    batch = driver.run(LocalExecutor(_table(range(30))), parallelism=2)
    assert len(batch.metadata.outputs) == 2
    in_checkpoint = Counter()
    for f in batch.metadata.outputs:
        in_checkpoint.update(map(tuple, (tuple(r.values()) for r in pq.read_table(
            driver.storage.url(f)).to_pylist())))
    assert in_checkpoint == _visible(out) and sum(in_checkpoint.values()) == 30


def test_a_subtask_that_fails_after_staging_leaves_nothing_visible(tmp_path):
    out = tmp_path / "out"
    driver = _driver(tmp_path, ParquetSink(str(out)), function=FailsAtSnapshot())
    with pytest.raises(RuntimeError, match="disk full"):
        driver.run(LocalExecutor(_table(range(50))), parallelism=2)
    assert _visible(out) == Counter() and _staged(out) == []
    assert driver.storage.checkpoint_ids() == []
    # the job goes on with a working function: only its output is visible
    good = _driver(tmp_path, ParquetSink(str(out)))
    good.run(LocalExecutor(_table(range(50))), parallelism=2)
    model = Model()
    model.commit(range(50))
    assert _visible(out) == model.rows


class _HalfWriter(SinkWriter):
    """Stages its first batch through a real Parquet writer, then fails at the second."""

    def __init__(self, inner):
        self.inner, self.batches = inner, 0

    def write(self, batch):
        self.batches += 1
        if self.batches == 2:
            raise OSError("connection reset while writing")
        self.inner.write(batch)

    def prepare_commit(self):
        return self.inner.prepare_commit()

    def abort(self):
        self.inner.abort()


class HalfWritingSink(ParquetSink):
    def create_writer(self, context):
        return _HalfWriter(super().create_writer(context))


def test_a_writer_that_fails_halfway_is_aborted(tmp_path, monkeypatch):
    from keygroups.runtime import sink as sink_module

    monkeypatch.setattr(sink_module, "SINK_BATCH_ROWS", 10)   # several batches per subtask
    out = tmp_path / "out"
    driver = _driver(tmp_path, HalfWritingSink(str(out)))
    with pytest.raises(OSError, match="connection reset"):
        driver.run(LocalExecutor(_table(range(60))), parallelism=1)
    assert os.path.isdir(os.path.join(out, STAGING))   # it did stage something before it failed
    assert _staged(out) == [] and _visible(out) == Counter()
    assert driver.storage.checkpoint_ids() == []


def test_a_lost_compare_and_swap_aborts_the_staged_output(tmp_path):
    out = tmp_path / "out"
    a = _driver(tmp_path, ParquetSink(str(out)))
    model = Model()
    a.run(LocalExecutor(_table(range(20))), parallelism=2)
    model.commit(range(20))
    b = _driver(tmp_path, ParquetSink(str(out)))   # another driver commits checkpoint 2 behind a's back
    b.run(LocalExecutor(_table(range(10))), parallelism=3)
    model.commit(range(10))
    with pytest.raises(ConcurrentCommitError):
        a.run(LocalExecutor(_table(range(1000, 1010))), parallelism=2)   # planned from 1: refused
    assert _visible(out) == model.rows and _staged(out) == []


def test_a_driver_that_dies_between_the_commits_is_repaired_on_restart(tmp_path):
    out = tmp_path / "out"
    model = Model()
    first = _driver(tmp_path, ParquetSink(str(out)))
    first.run(LocalExecutor(_table(range(30))), parallelism=2)
    model.commit(range(30))
    dying = _dying(tmp_path, out)
    with pytest.raises(Crash):
        dying.run(LocalExecutor(_table(range(10, 40), v=5)), parallelism=3)
    model.commit(range(10, 40), v=5)   # checkpoint 2 is committed: its state changes are in
    assert dying.storage.checkpoint_ids()[-1] == 2
    assert _visible(out) != model.rows and _staged(out)   # its output is staged, not visible
    restarted = _driver(tmp_path, ParquetSink(str(out)))
    restarted.run(LocalExecutor(_table([1, 2, 3], v=7)), parallelism=2)   # checkpoint 3, after publishing 2
    model.commit([1, 2, 3], v=7)
    assert _visible(out) == model.rows and _staged(out) == []
    # and committing checkpoint 2 once more (another restart) adds nothing
    again = _driver(tmp_path, ParquetSink(str(out)))
    props = BatchProperties.of(again.storage.load(2))
    ParquetSink(str(out)).commit(2, [r.sink_committable for r in props.reports if r.sink_committable])
    assert _visible(out) == model.rows


def test_a_replayed_streaming_batch_publishes_what_its_dead_driver_staged(tmp_path):
    out = tmp_path / "out"
    dying = _dying(tmp_path, out)
    with pytest.raises(Crash):
        dying.run(LocalExecutor(_table(range(25))), parallelism=2, streaming=StreamingBatch(0, "q"))
    restarted = _driver(tmp_path, ParquetSink(str(out)))
    batch = restarted.run(LocalExecutor(_table(range(25))), parallelism=2, streaming=StreamingBatch(0, "q"))
    assert batch.replayed
    model = Model()
    model.commit(range(25))
    assert _visible(out) == model.rows and _staged(out) == []
    restarted.run(LocalExecutor(_table(range(25))), parallelism=2, streaming=StreamingBatch(0, "q"))   # again
    assert _visible(out) == model.rows


def test_a_failing_commit_is_retried_before_the_next_batch(tmp_path):
    out = tmp_path / "out"
    sink = FlakyParquetSink(str(out), failures=2)
    driver = _driver(tmp_path, sink)
    with pytest.raises(SinkCommitError, match="checkpoint 1 .* is committed") as e:
        driver.run(LocalExecutor(_table(range(10))), parallelism=2)
    assert e.value.checkpoint_id == 1 and driver.storage.checkpoint_ids() == [1]
    with pytest.raises(SinkCommitError):   # retried first, fails again: no batch runs past it
        driver.run(LocalExecutor(_table(range(100, 110))), parallelism=2)
    assert driver.storage.checkpoint_ids() == [1] and _visible(out) == Counter()
    driver.run(LocalExecutor(_table(range(100, 110))), parallelism=2)
    model = Model()
    model.commit(range(10))
    model.commit(range(100, 110))
    assert _visible(out) == model.rows and _staged(out) == []


def test_an_orphaned_run_is_cleaned_by_the_next_commit_and_another_jobs_is_left_alone(tmp_path):
    out = tmp_path / "out"
    orphan = os.path.join(out, STAGING, _job_dir("j"), "chk-1-deadbeef", "part-0000000001-00000-0-x.parquet")
    other = os.path.join(out, STAGING, _job_dir("j/2"), "chk-1-0123abcd", "part-0000000001-00000-0-y.parquet")
    for path in (orphan, other):
        os.makedirs(os.path.dirname(path))
        with open(path, "wb") as f:
            f.write(b"a killed attempt's bytes")
    driver = _driver(tmp_path, ParquetSink(str(out)))
    driver.run(LocalExecutor(_table(range(5))), parallelism=1)
    assert sum(_visible(out).values()) == 5
    assert _staged(out) == [os.path.relpath(other, os.path.join(out, STAGING))]   # another job's: not ours to clean


class KilledFirstAttempt(ParquetSink):
    """Attempt 0 of every subtask stages its whole output, then its process is killed (no abort runs)."""

    def create_writer(self, context):
        writer = super().create_writer(context)
        if context.attempt > 0:
            return writer

        class Killed(_HalfWriter):
            def prepare_commit(self):
                self.inner.prepare_commit()   # staged, fsync'd
                raise Crash("executor lost")

            def abort(self):
                pass   # a killed process aborts nothing

        return Killed(writer)


class RetryingExecutor(LocalExecutor):
    """The local executor, retrying a subtask whose attempt failed, as Spark does (with the next attempt number)."""

    def _run(self, index, batches):
        from keygroups.runtime.subtask import run_keyed_subtask

        for attempt in range(2):
            try:
                report = run_keyed_subtask(self._spec, index, batches, attempt=attempt)
            except Crash:
                continue
            return SubtaskReport.from_json(json.loads(json.dumps(report.to_json())))
        raise AssertionError("no attempt succeeded")


def test_only_the_attempt_that_reported_is_published_and_a_killed_ones_staging_is_cleaned(tmp_path):
    out = tmp_path / "out"
    driver = _driver(tmp_path, KilledFirstAttempt(str(out)))
    batch = driver.run(RetryingExecutor(_table(range(60))), parallelism=3)
    assert {r.sink_committable.attempt for r in batch.reports if r.sink_committable} == {1}
    model = Model()
    model.commit(range(60))
    assert _visible(out) == model.rows and _staged(out) == []


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 4), st.lists(st.integers(0, 40), max_size=30),
                          st.sampled_from(["ok", "ok", "task fails", "driver dies", "commit lost"])),
                min_size=1, max_size=6))
def test_what_a_reader_sees_is_the_committed_batches_whatever_fails(tmp_path_factory, steps):
    root = tmp_path_factory.mktemp("prop")
    out = root / "out"
    model = Model()
    driver = _driver(root, ParquetSink(str(out)))
    for i, (p, keys, fate) in enumerate(steps):
        table = _table(keys, v=i + 1)
        if fate == "task fails":
            with pytest.raises(RuntimeError):
                _driver(root, ParquetSink(str(out)), function=FailsAtSnapshot()).run(LocalExecutor(table),
                                                                                     parallelism=p)
            driver = _driver(root, ParquetSink(str(out)))
        elif fate == "driver dies":
            with pytest.raises(Crash):
                _dying(root, out).run(LocalExecutor(table), parallelism=p)
            model.commit(keys, v=i + 1)
            driver = _driver(root, ParquetSink(str(out)))   # restarted: publishes it at its first batch
        elif fate == "commit lost":   # another driver commits behind this one's back: this one's batch is refused
            driver.run(LocalExecutor(_table([])), parallelism=1)   # (so that it knows the latest checkpoint)
            _driver(root, ParquetSink(str(out))).run(LocalExecutor(table), parallelism=p)
            model.commit(keys, v=i + 1)
            with pytest.raises(ConcurrentCommitError):
                driver.run(LocalExecutor(_table([k + 1000 for k in keys] or [1000])), parallelism=p)
        else:
            driver.run(LocalExecutor(table), parallelism=p)
            model.commit(keys, v=i + 1)
    driver.run(LocalExecutor(_table([])), parallelism=1)   # a last batch: a restarted driver publishes first
    assert _visible(out) == model.rows
    assert _staged(out) == []


# ---- the other sinks, and the harness ---------------------------------------------------------------------------

def test_the_counting_sink_counts_each_committed_checkpoint_once(tmp_path):
    sink = CountingSink()
    driver = _driver(tmp_path, sink)
    driver.run(LocalExecutor(_table(range(70))), parallelism=3)
    driver.run(LocalExecutor(_table(range(5))), parallelism=2)
    driver.run(LocalExecutor(_table(range(5))), parallelism=2, streaming=None, checkpoint_id=2)   # a replay
    assert sink.committed == {1: 70, 2: 5} and sink.rows == 75


def test_the_harness_runs_a_sink_like_a_job(tmp_path):
    seen: list[tuple[int, int, int]] = []

    def record(batch, context):
        seen.append((context.checkpoint_id, context.subtask_index, batch.num_rows))

    counting, out = CountingSink(), tmp_path / "out"
    for sink in (counting, TaskFunctionSink(record), ParquetSink(str(out))):
        with KeyedFunctionHarness(Total(), "k", output_schema=OUT, parallelism=2, max_parallelism=16,
                                  sink=sink) as h:
            h.process([{"k": k, "v": 1} for k in range(9)])
            h.process([{"k": 1, "v": 1}])
            assert len(h.output()) == 10   # the harness still shows every record
    assert counting.committed == {1: 9, 2: 1}
    assert sorted(seen)[-1][0] == 2 and sum(n for _, _, n in seen) == 10
    assert sum(_visible(out).values()) == 10


# ---- clear errors -----------------------------------------------------------------------------------------------

def test_bad_sinks_are_refused_by_name(tmp_path):
    with pytest.raises(TypeError, match="sink must be a keygroups.sinks.Sink .*TaskFunctionSink"):
        _driver(tmp_path, lambda batch: None)
    with pytest.raises(TypeError, match="sink must be a keygroups.sinks.Sink .*got str"):
        _driver(tmp_path, "/tmp/out")
    with pytest.raises(ValueError, match="checkpoint_output=False needs a sink"):
        _driver(tmp_path, None, checkpoint_output=False)
    with pytest.raises(ValueError, match="compression must be one of"):
        ParquetSink(str(tmp_path), compression="lzo")
    with pytest.raises(TypeError, match="TaskFunctionSink takes a function"):
        TaskFunctionSink(3)
    with pytest.raises(TypeError, match="Can't instantiate abstract class"):
        Sink()  # type: ignore[abstract]


class _Returns(Sink):
    def __init__(self, writer):
        self.writer = writer

    def create_writer(self, context):
        return self.writer

    def commit(self, checkpoint_id, committables):
        pass


class _Committing(SinkWriter):
    def __init__(self, value):
        self.value = value

    def write(self, batch):
        pass

    def prepare_commit(self):
        return self.value


def test_bad_writers_and_committables_fail_the_task_with_what_is_allowed(tmp_path):
    context = SinkContext("j", 0, 1, 1, "run")
    with pytest.raises(TypeError, match="create_writer must return a keygroups.sinks.SinkWriter, got dict"):
        TaskSink(_Returns({}), context)
    with pytest.raises(TypeError, match="prepare_commit must return JSON .*got set"):
        TaskSink(_Returns(_Committing({1, 2})), context).prepare_commit()
    with pytest.raises(ValueError, match=f"at most {MAX_COMMITTABLE_BYTES} are allowed"):
        TaskSink(_Returns(_Committing("x" * MAX_COMMITTABLE_BYTES)), context).prepare_commit()
    driver = _driver(tmp_path, _Returns(_Committing(float("nan"))))
    with pytest.raises(TypeError, match="must return JSON"):
        driver.run(LocalExecutor(_table(range(3))), parallelism=1)
    assert driver.storage.checkpoint_ids() == []


def test_a_restart_with_another_sink_refuses_to_drop_staged_output(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(Crash):
        _dying(tmp_path, out).run(LocalExecutor(_table(range(5))), parallelism=1)
    with pytest.raises(KeyGroupsError, match=r"staged by sink\(s\) \['keygroups.parquet'\].*keygroups.counting"):
        _driver(tmp_path, CountingSink()).run(LocalExecutor(_table(range(5))), parallelism=1)
    _driver(tmp_path, ParquetSink(str(out))).run(LocalExecutor(_table(range(5))), parallelism=1)
    assert sum(_visible(out).values()) == 10


def test_a_report_carries_its_committable_through_json_and_the_checkpoint():
    c = SinkCommittable("keygroups.parquet", 3, 1, "abc", {"staged": "_staging/x", "file": "part-1.parquet"})
    report = SubtaskReport(subtask=3, key_group_range=KeyGroupRange(0, 3), output_file=None,
                           restored=RestoreInfo.new(), sink_committable=c)
    assert SubtaskReport.from_json(json.loads(json.dumps(report.to_json()))) == report
    assert SubtaskReport.from_json(json.loads(json.dumps(report.stored()))).sink_committable == c
    with pytest.raises(Exception, match="sink committable is malformed"):
        SubtaskReport.from_json({**report.stored(), "sink_committable": {"sink": "x", "subtask": "3"}})


# ---- on an object store -----------------------------------------------------------------------------------------

def test_the_parquet_sink_on_s3_publishes_each_batch_once(s3_server, tmp_path):
    """SeaweedFS on 127.0.0.1 through s3fs: staged objects under ``_staging/``, published by copy and delete, a
    driver that died between the commits repaired by the next one."""
    url = s3_server.url() + "/sink-out"
    options = s3_server.storage_options

    def sink():
        return ParquetSink(url, storage_options=options)

    class DyingOnS3(ParquetSink):
        def commit(self, checkpoint_id, committables):
            if checkpoint_id == 2:
                raise Crash("driver died")
            super().commit(checkpoint_id, committables)

    model = Model()
    _driver(tmp_path, sink()).run(LocalExecutor(_table(range(40))), parallelism=2)
    model.commit(range(40))
    with pytest.raises(Crash):
        _driver(tmp_path, DyingOnS3(url, storage_options=options)).run(LocalExecutor(_table(range(20), v=3)),
                                                                         parallelism=3)
    model.commit(range(20), v=3)
    _driver(tmp_path, sink()).run(LocalExecutor(_table([5], v=2)), parallelism=1)
    model.commit([5], v=2)
    fs = s3_server.filesystem()
    root = url.removeprefix("s3://")
    table = pq.read_table(root, filesystem=fs)   # Arrow's dataset reader skips _staging/
    assert Counter(map(tuple, (tuple(r.values()) for r in table.to_pylist()))) == model.rows
    assert not [p for p in fs.find(root) if "/_staging/" in p]
    storage = CheckpointStorage(str(tmp_path / "chk"))
    with_output = sum(r.records_out > 0 for cid in (1, 2, 3) for r in BatchProperties.of(storage.load(cid)).reports)
    assert len(sink().committed_files()) == with_output
