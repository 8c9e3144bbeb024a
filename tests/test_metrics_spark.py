"""keygroups metrics where Spark users look, on the shared local Spark session: every batch of a ``KeyedJob`` (its
rescales with their moved bytes) in ``spark.read.format("keygroups").option("view", "metrics")`` at each level,
with Spark's own time for the batch's jobs and tasks read from its status store; the store bounded; and the
streaming listener bridge pairing each query progress with the keygroups metrics of the same batch."""

from __future__ import annotations

import threading

import pytest

from keygroups.errors import CheckpointNotFoundError
from keygroups.metrics import job_metrics
from keygroups.runtime.assignment import DECISION_PROPERTY
from keygroups.spark import KeyedJob, KeyGroupsProgressListener, ProgressWithMetrics, register
from spark_functions import TOTALS, RunningTotal

pytestmark = pytest.mark.spark
MP = 16


def view(spark, location, **options):
    register(spark)   # format("keygroups") in this session (registered per session)
    reader = spark.read.format("keygroups").option("view", "metrics")
    for k, v in options.items():
        reader = reader.option(k, v)
    return reader.load(location)


def test_every_batch_with_its_rescale_and_spark_time_in_the_metrics_view(spark, tmp_path):
    location = str(tmp_path / "chk")
    job = KeyedJob("metrics-view", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MP,
                   checkpoint_location=location)
    parallelisms = [2, 3, 1]
    records = [200, 300, 120]
    decisions = []
    for p, n in zip(parallelisms, records):
        result = job.run_batch(spark.createDataFrame([(i % 37, i) for i in range(n)], "k long, v long"),
                               parallelism=p)
        decisions.append(result.metadata.properties[DECISION_PROPERTY])

    job_metrics(job).flush()   # recorded in the background: the view's Python workers read the files
    batches = view(spark, location).orderBy("checkpoint_id").collect()
    assert [b["checkpoint_id"] for b in batches] == [1, 2, 3]
    assert [b["parallelism"] for b in batches] == parallelisms
    assert [b["records_in"] for b in batches] == records
    assert [b["rescaled"] for b in batches] == [False, True, True]
    assert [b["previous_parallelism"] for b in batches] == [None, 2, 3]
    for b, decision in zip(batches, decisions):
        assert b["moved_bytes"] == decision["moved_bytes"] and b["moved_key_groups"] == decision["moved_key_groups"]
        assert 0 < b["spark_seconds"] <= b["wall_seconds"]
        assert b["ours_seconds"] == pytest.approx(b["wall_seconds"] - b["spark_seconds"])
    assert all(b["moved_bytes"] > 0 for b in batches[1:])

    subtasks = view(spark, location, level="subtask").orderBy("checkpoint_id", "subtask").collect()
    assert [(s["checkpoint_id"], s["subtask"]) for s in subtasks] == [
        (c, i) for c, p in zip(range(1, 4), parallelisms) for i in range(p)]
    for s in subtasks:   # each subtask's Spark task, which holds our phases
        assert s["spark_task_seconds"] is not None and s["spark_task_seconds"] >= s["ours_seconds"] * 0.9
    groups = view(spark, location, level="keyGroup").collect()
    assert len(groups) == 3 * MP
    assert [sum(g["records"] for g in groups if g["checkpoint_id"] == c) for c in (1, 2, 3)] == records
    assert {g["restore_mode"] for g in groups if g["checkpoint_id"] == 1} == {"none"}
    assert {g["restore_mode"] for g in groups if g["checkpoint_id"] == 2} <= {"warm", "caught-up", "cold"}


def test_a_keyed_job_records_in_the_background_yet_every_batch_is_seen_at_once(spark, tmp_path, monkeypatch,
                                                                                caplog):
    import gc

    import keygroups.spark.metrics as spark_metrics
    from keygroups.metrics import MetricsStore
    from keygroups.metrics.recorder import flush_metrics

    location = str(tmp_path / "chk")
    job = KeyedJob("metrics-background", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MP,
                   checkpoint_location=location)
    recorder = job_metrics(job)
    threads = []
    real = spark_metrics.record_spark_batch

    def recording(*args):
        threads.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(spark_metrics, "record_spark_batch", recording)
    for cid, p in zip(range(1, 4), [2, 3, 1]):
        job.run_batch(spark.createDataFrame([(i % 13, i) for i in range(50 * cid)], "k long, v long"),
                      parallelism=p)
        assert recorder.latest is not None and recorder.latest.checkpoint_id == cid   # right after run_batch
        assert [m.checkpoint_id for m in recorder.history()] == list(range(1, cid + 1))
        assert recorder.latest.spark_seconds is not None
    assert threads and all(t != threading.main_thread().name for t in threads)   # off the batch's thread

    def failing(*args):
        raise RuntimeError("the recorder broke")

    monkeypatch.setattr(spark_metrics, "record_spark_batch", failing)
    with caplog.at_level("ERROR", logger="keygroups.metrics"):
        result = job.run_batch(spark.createDataFrame([(1, 1)], "k long, v long"), parallelism=2)
        assert result.checkpoint_id == 4 and recorder.flush()
    assert "the recorder broke" in caplog.text and recorder.latest.checkpoint_id == 3
    monkeypatch.setattr(spark_metrics, "record_spark_batch", real)   # the worker goes on after a failure
    job.run_batch(spark.createDataFrame([(2, 2)], "k long, v long"), parallelism=2)
    assert recorder.latest.checkpoint_id == 5

    job.run_batch(spark.createDataFrame([(3, 3)], "k long, v long"), parallelism=2)
    del job, recorder   # the job gone: what interpreter exit does (flush_metrics) still finds every batch stored
    gc.collect()
    assert flush_metrics(60)
    assert MetricsStore(location).checkpoint_ids() == [1, 2, 3, 5, 6]
    assert [b["checkpoint_id"] for b in view(spark, location).orderBy("checkpoint_id").collect()] == [1, 2, 3, 5, 6]


def test_the_metrics_view_options_are_checked_on_the_driver(tmp_path):
    from keygroups.metrics import MetricsStore
    from keygroups.spark.state_source import _Request
    from test_metrics import harness, records

    with harness() as h:
        job_metrics(h)
        for b in range(3):
            h.process(records([b, b + 1], [10 * b, 10 * b + 1]))
        location = h.storage.location
        assert MetricsStore(location).checkpoint_ids() == [1, 2, 3]
        request = _Request({"path": location, "view": "metrics", "checkpointId": "2", "level": "keyGroup"})
        assert request.metric_ids == [2] and request.arrow_schema.names[:3] == ["job", "checkpoint_id", "key_group"]
        with pytest.raises(CheckpointNotFoundError, match="no metrics of checkpoint 9"):
            _Request({"path": location, "view": "metrics", "checkpointId": "9"})
        with pytest.raises(ValueError, match="option 'level' must be batch, subtask or keyGroup, got 'keys'"):
            _Request({"path": location, "view": "metrics", "level": "keys"})
        with pytest.raises(ValueError, match="option 'level' is the metrics view's"):
            _Request({"path": location, "view": "metadata", "level": "batch"})


def test_the_listener_pairs_each_query_progress_with_the_batch_metrics(spark, tmp_path):
    source = tmp_path / "in"
    sizes = [120, 80, 200]
    for i, n in enumerate(sizes):
        spark.createDataFrame([(r % 20, r) for r in range(n)], "k long, v long").coalesce(1).write.parquet(
            str(source / f"part-{i}"))
    job = KeyedJob("metrics-stream", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MP,
                   checkpoint_location=str(tmp_path / "chk"))
    paired: list[ProgressWithMetrics] = []
    done = threading.Event()

    def on_progress(p):
        paired.append(p)
        if len(paired) >= len(sizes):
            done.set()

    listener = KeyGroupsProgressListener(job, on_progress)
    spark.streams.addListener(listener)
    try:
        query = (spark.readStream.schema("k long, v long").option("maxFilesPerTrigger", 1)
                 .parquet(str(source / "part-*")).writeStream.foreachBatch(job.foreach_batch(parallelism=2))
                 .option("checkpointLocation", str(tmp_path / "spark-chk")).trigger(availableNow=True).start())
        query.awaitTermination(300)
        assert query.exception() is None
        assert done.wait(60), f"{len(paired)} progresses reached the listener"
    finally:
        spark.streams.removeListener(listener)
    by_batch = {p.progress.batchId: p for p in paired}
    assert sorted(by_batch) == [0, 1, 2]
    for batch_id, n in enumerate(sizes):
        p = by_batch[batch_id]
        assert p.metrics is not None and p.metrics.checkpoint_id == batch_id
        assert p.metrics.records_in == p.progress.numInputRows == n
        d = p.to_dict()
        assert d["batchId"] == batch_id and d["keygroups"]["records_in"] == n
        assert d["keygroups"]["spark_seconds"] is not None
