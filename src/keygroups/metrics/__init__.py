"""What a job did, batch after batch, per subtask and per key group: metrics kept beside the checkpoints, exported to
Prometheus and drawn as a dashboard (no pyspark here: the Spark parts, the ``metrics`` view of
``spark.read.format("keygroups")`` and the streaming listener bridge, are in :mod:`keygroups.spark`).

- :class:`BatchMetrics`: one committed batch in figures: the batch's (records in, late and out, the watermark,
  timers, state, bytes restored and written, the assignment's decision and the rescale with its moved bytes, the
  driver's time split into Spark's jobs and ours), each subtask's (:class:`SubtaskMetrics`: records, restore mode,
  its phase times beside its Spark task's) and each key group's (:class:`KeyGroupFigures`: records, calls, timers
  fired, state bytes, moved bytes, decayed work, how its state came), built by :func:`batch_metrics`.
- :func:`job_metrics`: a job's :class:`MetricsRecorder`. A ``KeyedJob`` records every batch after its commit (never
  failing it) into a :class:`MetricsStore` in ``<checkpoint location>/_metrics/``, the last ``keep`` batches (100 by
  default); the test harness records once asked. A ``KeyedJob`` records on a background thread, off the batch's
  critical path: the recorder's readers, Prometheus scrapes and interpreter exit wait for it; before reading the
  ``metrics`` view (or the store's files) right after a batch, call ``job_metrics(job).flush()``.
- :func:`serve_prometheus` (:class:`PrometheusExporter`): the driver's jobs in Prometheus' text format, labelled by
  ``job_name``, ``subtask_index`` and ``key_group``.
- :func:`write_dashboard` (``keygroups dashboard LOCATION -o report.html``): one self-contained HTML page (plotly,
  its JavaScript inside): a key-group heat map over batches, each subtask's load against its range, the rescale
  history with moved bytes, late records, state growth, each batch's time split into ours and Spark's.
- :func:`batch_table`, :func:`subtask_table`, :func:`key_group_table`: the history as Arrow tables.

Turn recording off for a job with ``job_metrics(job).enabled = False``.
"""

from keygroups.metrics.adapter import batch_metrics
from keygroups.metrics.dashboard import dashboard_html, write_dashboard
from keygroups.metrics.model import (
    BATCH_SCHEMA,
    KEY_GROUP_SCHEMA,
    RESTORE_MODES,
    SUBTASK_PHASES,
    SUBTASK_SCHEMA,
    BatchMetrics,
    KeyGroupFigures,
    SubtaskMetrics,
    batch_table,
    key_group_table,
    metrics_table,
    subtask_table,
)
from keygroups.metrics.prometheus import PrometheusExporter, serve_prometheus
from keygroups.metrics.recorder import SERIES, MetricsRecorder, job_metrics, record_batch
from keygroups.metrics.store import DEFAULT_KEEP, METRICS_DIR, MetricsStore

__all__ = ["BatchMetrics", "SubtaskMetrics", "KeyGroupFigures", "RESTORE_MODES", "SUBTASK_PHASES", "BATCH_SCHEMA",
           "SUBTASK_SCHEMA", "KEY_GROUP_SCHEMA", "batch_metrics", "batch_table", "subtask_table", "key_group_table",
           "metrics_table", "MetricsStore", "METRICS_DIR", "DEFAULT_KEEP", "MetricsRecorder", "job_metrics",
           "record_batch", "SERIES", "PrometheusExporter", "serve_prometheus", "dashboard_html", "write_dashboard"]
