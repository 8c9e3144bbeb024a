"""keygroups' metrics where Spark users look (see :mod:`keygroups.metrics` for the metrics themselves).

- :func:`spark_batch_listener`: what ``KeyedJob`` gives its batch spine to call once a batch has committed: it records
  the batch's metrics (:func:`record_spark_batch`) with Spark's own time for the batch's jobs and each subtask's
  Spark task, from Spark's status store (:func:`spark_batch_times`);
- :class:`KeyGroupsProgressListener`: a ``StreamingQueryListener`` that pairs each streaming query progress with the
  keygroups metrics of the same batch, for users who already ship query progress somewhere
  (:class:`ProgressWithMetrics`);
- the ``metrics`` view of ``spark.read.format("keygroups")`` is in :mod:`keygroups.spark.state_source`.

Spark's times come from the status store that feeds Spark's UI, read through the py4j gateway: the batch's jobs are
those carrying the job tag its executor set (:attr:`SparkExecutor.job_tag`); each object is read as one JSON document
(Jackson, which Spark ships), so a batch costs a handful of gateway calls whatever its jobs hold. Over Spark Connect
there is no gateway: the figures are None there.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql.streaming.listener import StreamingQueryListener

from keygroups.checkpoint import CheckpointStorage
from keygroups.metrics import BatchMetrics, MetricsStore, job_metrics
from keygroups.metrics.recorder import record_batch, recorder_for_batch
from keygroups.runtime.batch import BatchExecutor, CommittedBatch
from keygroups.spark.executor import SparkExecutor

log = logging.getLogger("keygroups.metrics")


class _StatusStore:
    """Spark's status store of one classic session, read as JSON documents (see the module docs)."""

    def __init__(self, spark: SparkSession) -> None:
        context = spark._sc   # classic sessions only (the caller checks)
        jvm = context._jvm
        self.mapper = jvm.com.fasterxml.jackson.databind.ObjectMapper()
        scala = getattr(getattr(jvm.com.fasterxml.jackson.module.scala, "DefaultScalaModule$"), "MODULE$")
        self.mapper.registerModule(scala)   # Options as values, Seqs as lists; Dates are epoch milliseconds
        jsc = context._jsc.sc()
        self.tracker, self.store = jsc.statusTracker(), jsc.statusStore()

    def read(self, obj: Any) -> Any:
        return json.loads(self.mapper.writeValueAsString(obj))


_STORES: weakref.WeakKeyDictionary[Any, _StatusStore] = weakref.WeakKeyDictionary()
_STORES_LOCK = threading.Lock()


def _status_store(spark: SparkSession) -> _StatusStore | None:
    context = getattr(spark, "_sc", None)
    if context is None or getattr(context, "_jsc", None) is None:
        return None
    with _STORES_LOCK:
        store = _STORES.get(context)
        if store is None:
            store = _STORES[context] = _StatusStore(spark)
        return store


def _union(spans: list[tuple[float, float]]) -> float:
    """The length of the union of ``spans`` (start, end)."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


@dataclass(frozen=True)
class SparkBatchTimes:
    """Spark's time for one batch: ``seconds``, the union of its jobs' runs (submission to completion), as the
    batch's report counts it; ``tasks``, subtask -> the duration of its Spark task in the batch's keyed stage (empty
    when that stage was not found)."""

    seconds: float
    tasks: dict[int, float]


def spark_batch_times(spark: SparkSession, job_tag: str, parallelism: int) -> SparkBatchTimes | None:
    """Spark's time for the batch whose jobs carry ``job_tag``, and its keyed stage's tasks (the newest of its jobs
    whose last stage ran ``parallelism`` tasks; task *i* ran subtask *i*); None over Spark Connect. Every object is
    read as one JSON document: a few gateway calls per job, however much each holds."""
    status = _status_store(spark)
    if status is None:
        return None
    now = time.time()
    jobs = [status.read(status.store.job(i))
            for i in sorted(status.read(status.tracker.getJobIdsForTag(job_tag)), reverse=True)]
    spans = [(j["submissionTime"] / 1000, j["completionTime"] / 1000 if j.get("completionTime") else now)
             for j in jobs if j.get("submissionTime") is not None]
    tasks: dict[int, float] = {}
    for job in jobs:   # newest first: the keyed stage's job, unless idle subtasks ran after it
        if not job.get("stageIds"):
            continue
        stage = status.read(status.store.lastStageAttempt(max(job["stageIds"])))
        if stage.get("numTasks") != parallelism:
            continue
        for task in status.read(status.store.taskList(stage["stageId"], stage["attemptId"], parallelism * 4)):
            if task.get("status") == "SUCCESS" and task.get("duration") is not None:
                tasks[int(task["index"])] = task["duration"] / 1000
        break
    return SparkBatchTimes(_union(spans), tasks)


def record_spark_batch(job: Any, batch: CommittedBatch, executor: BatchExecutor) -> BatchMetrics | None:
    """Record the committed ``batch`` of ``job`` (a ``KeyedJob``) with Spark's time for its jobs and tasks (see
    :func:`keygroups.metrics.record_batch`). Never raises: the batch is committed; a failure is logged."""
    try:
        if batch.replayed or not recorder_for_batch(job).enabled:
            return None
        times = None
        try:
            if isinstance(executor, (SparkExecutor, _SparkOfBatch)) and executor.job_tag is not None:
                times = spark_batch_times(executor.spark, executor.job_tag, batch.report.parallelism)
        except Exception as e:   # noqa: BLE001  # a status store we cannot read: the rest of the figures stand
            log.warning("Spark's status store could not be read for checkpoint %d: %s", batch.checkpoint_id, e)
        return record_batch(job, batch, job.storage, spark_seconds=None if times is None else times.seconds,
                            task_seconds=None if times is None else times.tasks)
    except Exception:   # noqa: BLE001  # never fail a committed batch
        log.exception("recording the metrics of checkpoint %s failed (the batch itself is committed)",
                      batch.checkpoint_id)
        return None


@dataclass(frozen=True)
class _SparkOfBatch:
    """What the background recording needs of a batch's :class:`SparkExecutor`, taken when the batch committed."""

    spark: SparkSession
    job_tag: str | None


def spark_batch_listener(job: Any) -> Callable[[CommittedBatch, BatchExecutor], None]:
    """What ``job`` (a ``KeyedJob``) gives its :class:`~keygroups.runtime.batch.JobDriver` as ``on_commit``: each
    committed batch's metrics recorded (:func:`record_spark_batch`) on the job recorder's background thread, off
    the batch's critical path; the call waits only for the previous batch's recording (see
    :mod:`keygroups.metrics.recorder` for the flush points). Holds ``job`` weakly."""
    ref = weakref.ref(job)

    def committed(batch: CommittedBatch, executor: BatchExecutor) -> None:
        owner = ref()
        if owner is None or batch.replayed:
            return
        recorder = recorder_for_batch(owner)
        if not recorder.enabled:
            return
        # its tag now (the executor may run the next batch meanwhile); record_spark_batch looked up at each call
        of_batch: Any = (_SparkOfBatch(executor.spark, executor.job_tag) if isinstance(executor, SparkExecutor)
                         else executor)
        recorder.submit(lambda: record_spark_batch(owner, batch, of_batch))

    return committed


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


__all__ = ["KeyGroupsProgressListener", "ProgressWithMetrics", "SparkBatchTimes", "record_spark_batch",
           "spark_batch_listener", "spark_batch_times"]
