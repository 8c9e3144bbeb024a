"""Recording every batch's metrics: a job's :class:`MetricsRecorder` (:func:`job_metrics`), and the running totals
this process exports (:class:`JobSeries`, one per job name, in :data:`SERIES`).

A job records every batch once it has committed: the batch's spine calls the listener the job gave it
(:func:`batch_listener`; ``KeyedJob``'s adds Spark's times), and :func:`record_batch` builds the batch's
:class:`~keygroups.metrics.BatchMetrics`, writes it to the job's :class:`~keygroups.metrics.MetricsStore` beside
the checkpoints, adds it to the job's running totals (what Prometheus scrapes) and hands it to the recorder's
subscribers (the Spark listener bridge). It never fails the batch: the checkpoint is committed by then, and a
failure to record is logged on the ``keygroups.metrics`` logger. The test harness records only once asked
(``job_metrics(harness)``): its batches take milliseconds, and most tests want none.

A ``KeyedJob`` records off the batch's critical path: its listener hands the committed batch to the recorder's one
background thread (:meth:`MetricsRecorder.submit`), which reads Spark's times and writes the metrics, one batch at a
time and in order. The next batch's commit waits for the previous recording first, so none is lost. Flush points
(each waits for the recordings under way): the recorder's readers (:attr:`~MetricsRecorder.latest`,
:meth:`~MetricsRecorder.recent`, :meth:`~MetricsRecorder.get`, :meth:`~MetricsRecorder.history`),
:meth:`MetricsRecorder.flush`, :func:`flush_metrics` (every job of this process), each Prometheus scrape, and
interpreter exit. The ``metrics`` view of ``spark.read.format("keygroups")`` reads the files in Spark's Python workers,
which cannot wait for this process: call ``job_metrics(job).flush()`` (or :func:`flush_metrics`) before reading it
right after a batch. The test harness records synchronously.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from keygroups.checkpoint import CheckpointStorage
from keygroups.metrics.adapter import batch_metrics
from keygroups.metrics.model import RESTORE_MODES, SUBTASK_PHASES, BatchMetrics
from keygroups.metrics.store import DEFAULT_KEEP, MetricsStore, check_keep
from keygroups.runtime.batch import CommittedBatch

log = logging.getLogger("keygroups.metrics")

#: How many of its last batches a recorder holds in memory (the listener bridge pairs Spark's progress with them).
RECENT = 32

#: Seconds a recorder's background thread waits idle for the next batch before it ends (the next batch starts one).
IDLE_SECONDS = 30.0


class _Worker:
    """A recorder's background thread: runs one task at a time, in order (a single slot: :meth:`submit` waits for
    the task under way first). Its thread ends after :data:`IDLE_SECONDS` idle and starts again with the next task."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._cond = threading.Condition()
        self._task: Callable[[], Any] | None = None
        self._thread: threading.Thread | None = None

    def submit(self, task: Callable[[], Any]) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._task is None)   # the previous recording first: in order, none lost
            self._task = task
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the task under way (none from this worker's own thread); False if ``timeout`` ran out first."""
        with self._cond:
            if threading.current_thread() is self._thread:
                return True
            return self._cond.wait_for(lambda: self._task is None, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._cond.wait_for(lambda: self._task is not None, IDLE_SECONDS):
                    self._thread = None
                    return
                task = self._task
            try:
                assert task is not None
                task()
            except Exception:   # noqa: BLE001  # the batch is committed: a recording's failure is logged
                log.exception("a background metrics recording failed (the batch itself is committed)")
            finally:
                with self._cond:
                    self._task = None
                    self._cond.notify_all()


class MetricsRecorder:
    """A job's metrics recording (see the module docs): ``enabled`` (record at all), ``keep`` (how many batches
    the store beside the checkpoints keeps), ``store`` (False: keep the metrics in memory and in the running totals
    only, writing nothing beside the checkpoints).

    :attr:`latest` and :meth:`recent` are the last batches recorded by this driver; :meth:`history` reads the
    store (every batch kept, whichever driver recorded it)."""

    def __init__(self, *, enabled: bool = True, keep: int = DEFAULT_KEEP, store: bool = True) -> None:
        self.enabled = bool(enabled)
        self.keep = check_keep(keep)
        self.store = bool(store)
        self._stores: dict[tuple[str, str], MetricsStore] = {}
        self._recent: OrderedDict[int, BatchMetrics] = OrderedDict()
        self._subscribers: list[Callable[[BatchMetrics], None]] = []
        self._lock = threading.Lock()
        self._location: tuple[str, dict[str, Any]] | None = None
        self._asked = False   # handed out by job_metrics (see there)
        self._worker: _Worker | None = None

    def __repr__(self) -> str:
        return f"MetricsRecorder(enabled={self.enabled}, keep={self.keep}, store={self.store})"

    def submit(self, task: Callable[[], Any]) -> None:
        """Run ``task`` (a batch's recording) on this recorder's background thread, after the recording under way
        (which this waits for); its exceptions are logged. See the module docs."""
        with self._lock:
            if self._worker is None:
                self._worker = _Worker("keygroups-metrics")
                _WORKERS.add(self)
            worker = self._worker
        worker.submit(task)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the batch recording under way on the background thread, if any (False: ``timeout`` ran out)."""
        worker = self._worker
        return True if worker is None else worker.flush(timeout)

    @property
    def latest(self) -> BatchMetrics | None:
        """The last batch this recorder recorded (None: none yet)."""
        self.flush()
        with self._lock:
            return next(reversed(self._recent.values()), None)

    def recent(self) -> list[BatchMetrics]:
        """The last batches this recorder recorded (at most :data:`RECENT`), oldest first."""
        self.flush()
        with self._lock:
            return list(self._recent.values())

    def get(self, checkpoint_id: int) -> BatchMetrics | None:
        """The recorded batch of checkpoint ``checkpoint_id`` if it is among the recent ones."""
        self.flush()
        with self._lock:
            return self._recent.get(checkpoint_id)

    def history(self, last: int | None = None) -> list[BatchMetrics]:
        """Every batch the store beside the checkpoints keeps (the ``last`` ones), oldest first; the recent ones of
        this recorder before its first batch knows the location, or when it does not store."""
        self.flush()
        store = self._metrics_store()
        if store is None or not self.store:
            recent = self.recent()
            return recent if last is None else recent[-last:] if last > 0 else []
        return store.history(last)

    def subscribe(self, callback: Callable[[BatchMetrics], None]) -> Callable[[], None]:
        """Call ``callback(metrics)`` after every batch recorded from now on (its exceptions are logged, never
        raised); returns the function that unsubscribes it."""
        with self._lock:
            self._subscribers.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                if callback in self._subscribers:
                    self._subscribers.remove(callback)

        return unsubscribe

    def _metrics_store(self) -> MetricsStore | None:
        if self._location is None:
            return None
        location, options = self._location
        key = (location, repr(sorted(options.items())))
        store = self._stores.get(key)
        if store is None or store.keep != self.keep:
            store = self._stores[key] = MetricsStore(location, storage_options=options, keep=self.keep)
        return store

    def add(self, metrics: BatchMetrics, storage: CheckpointStorage | None = None) -> None:
        """Record ``metrics`` (a batch of the job whose checkpoints ``storage`` holds): write it beside the
        checkpoints, add it to the running totals, hand it to the subscribers. Raises what writing raises; the
        batch's own call goes through :func:`record_batch`, which logs instead."""
        if storage is not None:
            self._location = (storage.location, dict(storage.storage_options))
        with self._lock:
            self._recent[metrics.checkpoint_id] = metrics
            self._recent.move_to_end(metrics.checkpoint_id)
            while len(self._recent) > RECENT:
                self._recent.popitem(last=False)
            subscribers = list(self._subscribers)
        SERIES.add(metrics)
        try:
            store = self._metrics_store() if self.store else None
            if store is not None:
                store.write(metrics)
        finally:
            for callback in subscribers:
                try:
                    callback(metrics)
                except Exception:   # noqa: BLE001  # a subscriber's failure is its own
                    log.exception("metrics subscriber %r failed on checkpoint %d", callback, metrics.checkpoint_id)


_RECORDERS: weakref.WeakKeyDictionary[Any, MetricsRecorder] = weakref.WeakKeyDictionary()
_RECORDERS_LOCK = threading.Lock()
_WORKERS: weakref.WeakSet[MetricsRecorder] = weakref.WeakSet()   # recorders that record in the background


def flush_metrics(timeout: float | None = None) -> bool:
    """Wait for every job's batch recording under way in this process (see the module docs); False if ``timeout``
    (seconds, per job) ran out for one. Prometheus scrapes and interpreter exit call it."""
    done = True
    for recorder in list(_WORKERS):
        done = recorder.flush(timeout) and done
    return done


atexit.register(flush_metrics, 60.0)


def job_metrics(job: Any) -> MetricsRecorder:
    """The :class:`MetricsRecorder` of ``job`` (a ``KeyedJob`` or a ``KeyedFunctionHarness``). A job records from
    its first batch anyway; a harness starts recording when this is first asked (its recorder is enabled then,
    unless turned off through this function since)."""
    return _recorder(job, enabled=True, asked=True)


def _recorder(job: Any, *, enabled: bool, asked: bool = False) -> MetricsRecorder:
    with _RECORDERS_LOCK:
        recorder = _RECORDERS.get(job)
        if recorder is None:
            recorder = _RECORDERS[job] = MetricsRecorder(enabled=enabled)
        elif asked and not recorder._asked:
            recorder.enabled = True   # made off by default by a batch: the first ask turns it on
        recorder._asked = recorder._asked or asked
        return recorder


def recorder_for_batch(job: Any, *, enabled_by_default: bool = True) -> MetricsRecorder:
    """The recorder a batch of ``job`` records with (made with ``enabled_by_default`` when ``job`` has none)."""
    return _recorder(job, enabled=enabled_by_default)


def record_batch(job: Any, batch: CommittedBatch, storage: CheckpointStorage | None, *,
                 spark_seconds: float | None = None, task_seconds: Mapping[int, float] | None = None,
                 enabled_by_default: bool = True) -> BatchMetrics | None:
    """Record the committed ``batch`` of ``job`` (its checkpoints in ``storage``; see
    :func:`~keygroups.metrics.batch_metrics` for the times). Called once the checkpoint is committed; never raises:
    a failure is logged (the batch went through) and gives None, as do a disabled recorder and a replayed batch
    (its first run recorded it)."""
    try:
        recorder = recorder_for_batch(job, enabled_by_default=enabled_by_default)
        if not recorder.enabled or batch.replayed:
            return None
        metrics = batch_metrics(batch, spark_seconds=spark_seconds, task_seconds=task_seconds)
        recorder.add(metrics, storage)
        return metrics
    except Exception:   # noqa: BLE001  # the batch is committed: its metrics must never fail it
        log.exception("recording the metrics of checkpoint %s of job %s failed (the batch itself is committed)",
                      batch.checkpoint_id, batch.metadata.job_id)
        return None


def batch_listener(job: Any, *, enabled_by_default: bool = True) -> Callable[[CommittedBatch, Any], None]:
    """What ``job`` (the test harness; ``KeyedJob`` adds Spark's times, see ``keygroups.spark.metrics``) gives its
    :class:`~keygroups.runtime.batch.JobDriver` as ``on_commit``: each committed batch recorded
    (:func:`record_batch`, a recorder made with ``enabled_by_default`` when the job has none). Holds ``job``
    weakly."""
    ref = weakref.ref(job)

    def committed(batch: CommittedBatch, executor: Any) -> None:
        owner = ref()
        if owner is not None:
            record_batch(owner, batch, getattr(owner, "storage", None), enabled_by_default=enabled_by_default)

    return committed


# ---- running totals ------------------------------------------------------------------------------------------------

def _grown(array: npt.NDArray[Any], length: int) -> npt.NDArray[Any]:
    if len(array) >= length:
        return array
    out = np.zeros((length, *array.shape[1:]), dtype=array.dtype)
    out[:len(array)] = array
    return out


@dataclass
class JobSeries:
    """A job's running totals since this process saw its first batch (Prometheus counters), and its latest batch
    (the gauges). Per subtask index and per key group; the key-group totals start again when the max parallelism
    changes (key group numbers then mean other key groups)."""

    job: str
    batches: int = 0
    rescales: int = 0
    moved_bytes: int = 0
    moved_key_groups: int = 0
    records_late: int = 0
    timers_registered: int = 0
    key_groups_restored: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros(len(RESTORE_MODES),
                                                                                          dtype=np.int64))
    wall_seconds: float = 0.0
    spark_seconds: float = 0.0
    ours_seconds: float = 0.0
    plan_seconds: float = 0.0
    commit_seconds: float = 0.0
    #: per subtask index: records in, late, out, bytes restored, bytes written
    subtask_counts: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros((0, 5), dtype=np.int64))
    #: per subtask index: seconds of each of SUBTASK_PHASES, then its Spark task's
    subtask_seconds: npt.NDArray[np.float64] = field(default_factory=lambda: np.zeros((0, len(SUBTASK_PHASES) + 1)))
    #: per key group: records, calls, timers fired, moved bytes
    key_group_counts: npt.NDArray[np.int64] = field(default_factory=lambda: np.zeros((0, 4), dtype=np.int64))
    latest: BatchMetrics | None = None

    def add(self, m: BatchMetrics) -> None:
        self.batches += 1
        self.rescales += int(m.rescaled)
        self.moved_bytes += m.moved_bytes
        self.moved_key_groups += m.moved_key_groups
        self.records_late += m.records_late
        self.timers_registered += m.timers_registered
        self.key_groups_restored += np.bincount(m.key_groups.restore.astype(np.int64), minlength=len(RESTORE_MODES))
        self.wall_seconds += m.wall_seconds or 0.0
        self.spark_seconds += m.spark_seconds or 0.0
        self.ours_seconds += m.ours_seconds or 0.0
        self.plan_seconds += m.plan_seconds
        self.commit_seconds += m.commit_seconds
        self.subtask_counts = _grown(self.subtask_counts, m.parallelism)
        self.subtask_seconds = _grown(self.subtask_seconds, m.parallelism)
        for s in m.subtasks:
            self.subtask_counts[s.subtask] += (s.records_in, s.records_late, s.records_out, s.bytes_restored,
                                               s.bytes_written)
            self.subtask_seconds[s.subtask] += (s.restore_seconds, s.prepare_seconds, s.process_seconds,
                                                s.timers_seconds, s.snapshot_seconds, s.spark_task_seconds or 0.0)
        if len(self.key_group_counts) != m.max_parallelism:
            self.key_group_counts = np.zeros((m.max_parallelism, 4), dtype=np.int64)
        kg = m.key_groups
        self.key_group_counts += np.stack([kg.records, kg.calls, kg.timers_fired, kg.moved_bytes], axis=1)
        self.latest = m


class MetricsSeries:
    """Every job's :class:`JobSeries` in this process, by job name (thread-safe: batches add, scrapes read)."""

    def __init__(self) -> None:
        self._jobs: dict[str, JobSeries] = {}
        self.lock = threading.Lock()

    def add(self, metrics: BatchMetrics) -> None:
        with self.lock:
            series = self._jobs.get(metrics.job)
            if series is None:
                series = self._jobs[metrics.job] = JobSeries(metrics.job)
            series.add(metrics)

    def jobs(self) -> list[JobSeries]:
        """The jobs' series (read them holding :attr:`lock`)."""
        return list(self._jobs.values())

    def get(self, job: str) -> JobSeries | None:
        return self._jobs.get(job)

    def clear(self) -> None:
        """Forget every job's totals."""
        with self.lock:
            self._jobs.clear()


#: This process's running totals, which :class:`~keygroups.metrics.PrometheusExporter` exports.
SERIES = MetricsSeries()


__all__ = ["MetricsRecorder", "JobSeries", "MetricsSeries", "SERIES", "job_metrics", "record_batch", "batch_listener",
           "recorder_for_batch", "flush_metrics", "RECENT"]
