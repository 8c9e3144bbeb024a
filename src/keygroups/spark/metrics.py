"""keygroups' metrics where Spark users look (see :mod:`keygroups.metrics` for the metrics themselves).

- :func:`record_spark_batch`: a ``KeyedJob`` batch's metrics, with Spark's own time for the batch's jobs and each
  subtask's Spark task, read from Spark's status store (:class:`SparkJobClock`);
- :class:`KeyGroupsProgressListener`: a ``StreamingQueryListener`` that pairs each streaming query progress with the
  keygroups metrics of the same batch, for users who already ship query progress somewhere
  (:class:`ProgressWithMetrics`);
- the ``metrics`` view of ``spark.read.format("keygroups")`` is in :mod:`keygroups.spark.state_source`.

Spark's time comes from the status store that feeds Spark's UI (``SparkContext.statusTracker`` and the store behind
it), read through the py4j gateway: the jobs of the batch's thread's job group (a streaming query's run id inside a
``foreachBatch``; none otherwise) that were submitted after the batch started and after the last batch's jobs, each
with its submission and completion times; their union is the batch's Spark time. Each object is read as one JSON
document (Jackson, which Spark ships), so a batch costs a handful of gateway calls whatever its jobs hold. Over Spark
Connect there is no gateway: the figures are None there.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql.streaming.listener import StreamingQueryListener

from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.metrics import BatchMetrics, MetricsRecorder, MetricsStore, job_metrics
from keygroups.metrics.recorder import record_batch, recorder_for_batch

log = logging.getLogger("keygroups.metrics")


def _union(spans: Sequence[tuple[float, float]]) -> float:
    """The length of the union of ``spans`` (start, end)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


@dataclass(frozen=True)
class SparkBatchTimes:
    """Spark's time for one batch: ``seconds`` (the union of its jobs' runs) and ``tasks`` (subtask -> the duration
    of its task in the batch's keyed stage; empty when that stage was not found), from ``jobs``."""

    seconds: float
    tasks: Mapping[int, float]
    jobs: tuple[int, ...]


class SparkJobClock:
    """Reads a batch's Spark jobs from the status store of a classic session (see the module docs), remembering the
    newest job id it has seen so that no job counts for two batches."""

    def __init__(self) -> None:
        self._newest_job = -1
        self._gateway: tuple[Any, Any, Any, Any] | None = None   # (context, mapper, tracker, store)
        self._lock = threading.Lock()

    def _objects(self, spark: SparkSession) -> tuple[Any, Any, Any, Any] | None:
        context = getattr(spark, "_sc", None)   # classic sessions only
        if context is None or getattr(context, "_jsc", None) is None:
            return None
        if self._gateway is None or self._gateway[0] is not context:
            jvm = context._jvm
            mapper = jvm.com.fasterxml.jackson.databind.ObjectMapper()
            scala = getattr(getattr(jvm.com.fasterxml.jackson.module.scala, "DefaultScalaModule$"), "MODULE$")
            mapper.registerModule(scala)   # Options as values, Seqs as lists; Dates are epoch milliseconds
            jsc = context._jsc.sc()
            self._gateway = (context, mapper, jsc.statusTracker(), jsc.statusStore())
        return self._gateway

    def batch_times(self, spark: SparkSession, started: float, parallelism: int) -> SparkBatchTimes | None:
        """Spark's time for the batch that started at ``started`` (epoch seconds) and has just committed, and its
        subtasks' tasks (the latest of its jobs whose last stage ran ``parallelism`` tasks: its keyed stage; task
        *i* ran subtask *i*). None over Spark Connect."""
        with self._lock:
            objects = self._objects(spark)
            if objects is None:
                return None
            context, mapper, tracker, store = objects
            now = time.time()

            def read(obj: Any) -> Any:
                return json.loads(mapper.writeValueAsString(obj))

            group = context.getLocalProperty("spark.jobGroup.id")
            ids = sorted((i for i in read(tracker.getJobIdsForGroup(group)) if i > self._newest_job), reverse=True)
            jobs: list[dict[str, Any]] = []
            for job_id in ids:   # newest first, down to the first job submitted before the batch
                job = read(store.job(job_id))
                submitted = job.get("submissionTime")
                if submitted is None or submitted / 1000 < started:
                    break
                jobs.append(job)
            if ids:
                self._newest_job = max(self._newest_job, ids[0])
            spans = [(max(j["submissionTime"] / 1000, started),
                      min(j["completionTime"] / 1000, now) if j.get("completionTime") else now) for j in jobs]
            tasks: dict[int, float] = {}
            for job in jobs:
                if not job.get("stageIds"):
                    continue
                stage = read(store.lastStageAttempt(max(job["stageIds"])))
                if stage.get("numTasks") != parallelism:
                    continue
                for task in read(store.taskList(stage["stageId"], stage["attemptId"], parallelism * 4)):
                    if task.get("status") == "SUCCESS" and task.get("duration") is not None:
                        tasks[int(task["index"])] = task["duration"] / 1000
                break
            return SparkBatchTimes(_union(spans), tasks, tuple(j["jobId"] for j in jobs))


_CLOCKS: weakref.WeakKeyDictionary[MetricsRecorder, SparkJobClock] = weakref.WeakKeyDictionary()
_CLOCKS_LOCK = threading.Lock()


def _clock(recorder: MetricsRecorder) -> SparkJobClock:
    with _CLOCKS_LOCK:
        clock = _CLOCKS.get(recorder)
        if clock is None:
            clock = _CLOCKS[recorder] = SparkJobClock()
        return clock


def record_spark_batch(job: Any, spark: SparkSession, storage: CheckpointStorage, metadata: CheckpointMetadata,
                       reports: Sequence[Mapping[str, Any]], previous: CheckpointMetadata | None, *,
                       started: float, commit_seconds: float | None = None) -> BatchMetrics | None:
    """Record the batch of ``job`` (a ``KeyedJob``) that committed ``metadata``, with Spark's time for its jobs and
    tasks (see :func:`keygroups.metrics.record_batch`; ``started`` on ``time.perf_counter``'s clock). Never raises:
    the batch is committed; a failure is logged."""
    try:
        recorder = recorder_for_batch(job)
        if not recorder.enabled:
            return None
        started_epoch = time.time() - (time.perf_counter() - started)
        try:
            times = _clock(recorder).batch_times(spark, started_epoch, metadata.parallelism)
        except Exception as e:   # noqa: BLE001  # a status store we cannot read: the rest of the figures stand
            log.warning("Spark's status store could not be read for checkpoint %d: %s", metadata.checkpoint_id, e)
            times = None
        return record_batch(job, storage, metadata, reports, previous, started=started,
                            commit_seconds=commit_seconds, spark_seconds=None if times is None else times.seconds,
                            task_seconds=None if times is None else times.tasks)
    except Exception:   # noqa: BLE001  # never fail a committed batch
        log.exception("recording the metrics of checkpoint %s failed (the batch itself is committed)",
                      getattr(metadata, "checkpoint_id", "?"))
        return None


# ---- streaming progress ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ProgressWithMetrics:
    """A streaming query's progress (``progress``: PySpark's ``StreamingQueryProgress``) and the keygroups metrics
    of the same batch (``metrics``; None when the job recorded none for it, e.g. a batch the query replayed, whose
    checkpoint was already complete)."""

    progress: Any
    metrics: BatchMetrics | None

    def to_dict(self) -> dict[str, Any]:
        """Spark's progress as its JSON (``progress.json``), with the batch's keygroups figures under
        ``"keygroups"`` (its batch figures; per-key-group arrays left out)."""
        out: dict[str, Any] = json.loads(self.progress.json)
        out["keygroups"] = None if self.metrics is None else self.metrics.batch_json()
        return out


class KeyGroupsProgressListener(StreamingQueryListener):
    """A ``StreamingQueryListener`` (``spark.streams.addListener(listener)``) that calls
    ``on_progress(ProgressWithMetrics)`` for every progress of the streaming query that runs ``job`` (a
    ``KeyedJob`` behind ``foreach_batch``), pairing it with the job's metrics of the same batch.

    Spark reports each micro-batch's progress once the batch has ended, so the job has recorded its metrics by
    then. A batch is found by the streaming query and batch id its checkpoint records, where it does; else by its
    checkpoint id, which ``foreach_batch`` takes from Spark's batch id. Progresses of other queries (another
    query id than the one the job's batches record) are passed over; ``query_name`` keeps only the query of that
    name. ``on_progress`` runs on Spark's listener thread: its exceptions are logged, never raised into Spark."""

    def __init__(self, job: Any, on_progress: Callable[[ProgressWithMetrics], None], *,
                 query_name: str | None = None) -> None:
        super().__init__()
        self.recorder = job_metrics(job)
        self._storage: CheckpointStorage | None = getattr(job, "storage", None)
        self.on_progress = on_progress
        self.query_name = query_name

    def _find(self, query_id: str, batch_id: int) -> BatchMetrics | None:
        recent = self.recorder.recent()
        for m in reversed(recent):
            if m.streaming_query_id == query_id and m.streaming_batch_id == batch_id:
                return m
        for m in reversed(recent):
            if m.streaming_batch_id is None and m.checkpoint_id == batch_id:
                return m
        if self._storage is not None and self.recorder.store:   # older than what the recorder holds: the store
            store = MetricsStore(self._storage.location, storage_options=self._storage.storage_options)
            try:
                m = store.read(batch_id)
            except FileNotFoundError:
                return None
            if m.streaming_batch_id is None or (m.streaming_query_id, m.streaming_batch_id) == (query_id, batch_id):
                return m
        return None

    def onQueryStarted(self, event: Any) -> None:
        pass

    def onQueryProgress(self, event: Any) -> None:
        progress = event.progress
        try:
            if self.query_name is not None and progress.name != self.query_name:
                return
            metrics = self._find(str(progress.id), int(progress.batchId))
            if metrics is None and self._other_query(str(progress.id)):
                return
            self.on_progress(ProgressWithMetrics(progress, metrics))
        except Exception:   # noqa: BLE001  # Spark's listener thread must go on
            log.exception("on_progress failed for batch %s of query %s", getattr(progress, "batchId", "?"),
                          getattr(progress, "id", "?"))

    def _other_query(self, query_id: str) -> bool:
        """Whether the job's batches name their query, and none of them this one."""
        named = {m.streaming_query_id for m in self.recorder.recent() if m.streaming_query_id is not None}
        return bool(named) and query_id not in named

    def onQueryIdle(self, event: Any) -> None:
        pass

    def onQueryTerminated(self, event: Any) -> None:
        pass


__all__ = ["KeyGroupsProgressListener", "ProgressWithMetrics", "SparkBatchTimes", "SparkJobClock",
           "record_spark_batch"]
