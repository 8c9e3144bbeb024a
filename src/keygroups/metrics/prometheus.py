"""The driver's metrics in Prometheus' text format: :class:`PrometheusExporter`, :func:`serve_prometheus`.

Every job of this process that records metrics (:mod:`keygroups.metrics.recorder`) is exported, from its running
totals (counters, ``..._total``: every batch counts, however rarely Prometheus scrapes) and its latest batch
(gauges). Labels: ``job_name`` (the job's name; not ``job``, which Prometheus sets to the scrape job's),
``subtask_index`` (as Flink's reporter names it) and ``key_group``. Per-key-group series are opt-in
(``key_groups=True``: one series per key group and metric, ``max_parallelism`` of them); the ``top_key_groups``
hottest key groups (by decayed work, what the balanced assignment weighs) are always exported.

Nothing is computed per batch for Prometheus beyond adding the batch to the totals; a scrape reads them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import numpy as np

from keygroups.metrics.model import RESTORE_MODES, SUBTASK_PHASES
from keygroups.metrics.recorder import SERIES, JobSeries, MetricsSeries, flush_metrics

#: The hottest key groups exported whatever ``key_groups`` says, by default.
DEFAULT_TOP_KEY_GROUPS = 10


def _families() -> Any:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    return CounterMetricFamily, GaugeMetricFamily


class PrometheusExporter:
    """A Prometheus collector of this process's keygroups jobs (see the module docs), served over HTTP by
    :meth:`start` (or :func:`serve_prometheus`). ``key_groups``: export every key group's series; ``top_key_groups``:
    how many of the hottest key groups are exported in any case (0: none)."""

    def __init__(self, *, key_groups: bool = False, top_key_groups: int = DEFAULT_TOP_KEY_GROUPS,
                 series: MetricsSeries = SERIES) -> None:
        if isinstance(top_key_groups, bool) or not isinstance(top_key_groups, int) or top_key_groups < 0:
            raise ValueError(f"top_key_groups must be an int >= 0 (the hottest key groups always exported), got "
                             f"{top_key_groups!r}")
        self.key_groups = bool(key_groups)
        self.top_key_groups = top_key_groups
        self.series = series
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._registry: Any = None

    # ---- serving -------------------------------------------------------------------------------------------------

    def start(self, port: int, addr: str = "0.0.0.0") -> PrometheusExporter:
        """Serve ``/metrics`` on ``addr``:``port`` (port 0: any free port, see :attr:`port`) from a daemon thread."""
        from prometheus_client import CollectorRegistry, start_http_server

        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in [0, 65535] (0: any free port), got {port!r}")
        if self._server is not None:
            raise RuntimeError(f"this exporter already serves on port {self.port}")
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)
        self._server, self._thread = start_http_server(port, addr=addr, registry=self._registry)
        return self

    @property
    def port(self) -> int | None:
        """The port it serves on (None: not serving)."""
        return None if self._server is None else int(self._server.server_port)

    def stop(self) -> None:
        """Stop serving."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = self._thread = None

    def text(self) -> str:
        """The exposition as a scrape would get it (Prometheus' text format)."""
        from prometheus_client import CollectorRegistry, generate_latest

        registry = self._registry
        if registry is None:
            registry = CollectorRegistry(auto_describe=False)
            registry.register(self)
        return generate_latest(registry).decode()

    # ---- the collector -------------------------------------------------------------------------------------------

    def describe(self) -> list[Any]:
        return []   # collected fresh at each scrape: nothing to describe up front

    def collect(self) -> Iterator[Any]:
        counter, gauge = _families()
        flush_metrics()   # the batches whose recording is under way in the background (see keygroups.metrics)
        with self.series.lock:
            jobs = [(s, _snapshot(s)) for s in self.series.jobs()]
        families: dict[str, Any] = {}

        def family(kind: Any, name: str, documentation: str, labels: tuple[str, ...], unit: str = "") -> Any:
            f = families.get(name)
            if f is None:
                f = families[name] = kind(name, documentation, labels=list(labels), unit=unit)
            return f

        for series, s in jobs:
            m = s["latest"]
            job = (series.job,)
            for name, doc, value in (
                    ("keygroups_batches", "Micro-batches committed", s["batches"]),
                    ("keygroups_rescales", "Batches that ran with other key-group ranges than their restore point",
                     s["rescales"]),
                    ("keygroups_moved_bytes", "State bytes of the key groups that changed holder in a rescale",
                     s["moved_bytes"]),
                    ("keygroups_moved_key_groups", "Key groups that changed holder in a rescale",
                     s["moved_key_groups"]),
                    ("keygroups_timers_registered", "Timers registered", s["timers_registered"])):
                family(counter, name, doc, ("job_name",)).add_metric(job, value)
            seconds = family(counter, "keygroups_batch_seconds",
                             "Seconds of batches on the driver: Spark's own jobs, ours (the rest), and the driver's "
                             "plan and commit phases", ("job_name", "part"))
            for part in ("wall", "spark", "ours", "plan", "commit"):
                seconds.add_metric((*job, part), s[f"{part}_seconds"])
            restored = family(counter, "keygroups_key_groups_restored",
                              "Key groups per batch by how their state came", ("job_name", "mode"))
            for mode, n in zip(RESTORE_MODES, s["key_groups_restored"]):
                restored.add_metric((*job, mode), int(n))
            for name, doc, value in (
                    ("keygroups_last_checkpoint_id", "The checkpoint of the latest batch", m.checkpoint_id),
                    ("keygroups_last_batch_timestamp_seconds", "When the latest batch committed (epoch seconds)",
                     m.timestamp_ms / 1000),
                    ("keygroups_parallelism", "Subtasks of the latest batch", m.parallelism),
                    ("keygroups_max_parallelism", "Key groups of the job", m.max_parallelism),
                    ("keygroups_state_bytes", "Bytes of the job's state after the latest batch", m.state_bytes),
                    ("keygroups_timers_pending", "Timers registered after the latest batch", m.timers_pending),
                    ("keygroups_load_max_over_mean", "The latest ranges' largest load over the mean (1: balanced)",
                     m.max_over_mean if m.max_over_mean is not None else float("nan")),
                    ("keygroups_watermark_seconds", "The watermark after the latest batch (epoch seconds)",
                     m.watermark_after / 1000 if m.watermark_after is not None else float("nan"))):
                family(gauge, name, doc, ("job_name",)).add_metric(job, value)
            last = family(gauge, "keygroups_last_batch_seconds", "Seconds of the latest batch on the driver",
                          ("job_name", "part"))
            for part, value in (("wall", m.wall_seconds), ("spark", m.spark_seconds), ("ours", m.ours_seconds)):
                if value is not None:
                    last.add_metric((*job, part), value)
            self._subtasks(family, counter, gauge, series.job, s)
            self._key_groups(family, counter, gauge, series.job, s)
        yield from families.values()

    def _subtasks(self, family: Any, counter: Any, gauge: Any, job: str, s: dict[str, Any]) -> None:
        counts, seconds, m = s["subtask_counts"], s["subtask_seconds"], s["latest"]
        labels = ("job_name", "subtask_index")
        names = (("keygroups_records_in", "Records the subtask got"),
                 ("keygroups_records_late", "Records at or before the watermark (dropped or sent to the late output)"),
                 ("keygroups_records_out", "Records the subtask's function returned"),
                 ("keygroups_restored_bytes", "Bytes of checkpoint files read to restore state"),
                 ("keygroups_written_bytes", "Bytes of state files written by snapshots"))
        for column, (name, doc) in enumerate(names):
            f = family(counter, name, doc, labels)
            for i in range(len(counts)):
                f.add_metric((job, str(i)), int(counts[i, column]))
        phases = family(counter, "keygroups_subtask_seconds",
                        "Seconds of the subtask's own phases, and of its Spark tasks (phase spark_task)",
                        ("job_name", "subtask_index", "phase"))
        for i in range(len(seconds)):
            for column, phase in enumerate((*SUBTASK_PHASES, "spark_task")):
                phases.add_metric((job, str(i), phase), float(seconds[i, column]))
        state = np.add.reduceat(m.key_groups.state_bytes, np.asarray(m.boundaries[:-1], dtype=np.int64))
        f = family(gauge, "keygroups_subtask_state_bytes", "Bytes of the subtask's key groups' state after the "
                   "latest batch", labels)
        entries = family(gauge, "keygroups_subtask_state_entries", "Entries of keyed state the subtask held after "
                         "the latest batch (the backend's estimate)", labels)
        for sub in m.subtasks:
            f.add_metric((job, str(sub.subtask)), int(state[sub.subtask]))
            if sub.state_entries is not None:
                entries.add_metric((job, str(sub.subtask)), sub.state_entries)

    def _key_groups(self, family: Any, counter: Any, gauge: Any, job: str, s: dict[str, Any]) -> None:
        m, counts = s["latest"], s["key_group_counts"]
        work = m.key_groups.decayed_work
        total = float(work.sum())
        if self.key_groups:
            chosen = np.arange(len(work))
        else:
            top = min(self.top_key_groups, len(work))
            chosen = np.sort(np.argsort(-work, kind="stable")[:top]) if top and total > 0 else np.zeros(0, int)
        if not len(chosen):
            return
        labels = ("job_name", "key_group")
        names = (("keygroups_key_group_records", "Records the key group processed"),
                 ("keygroups_key_group_calls", "Steps of the function for the key group: one per key of a batch, "
                                               "plus one per record for a function called per record"),
                 ("keygroups_key_group_timers_fired", "Timers fired in the key group"),
                 ("keygroups_key_group_moved_bytes", "State bytes of the key group moved to another holder"))
        for column, (name, doc) in enumerate(names):
            f = family(counter, name, doc, labels)
            for kg in chosen:
                f.add_metric((job, str(int(kg))), int(counts[kg, column]) if kg < len(counts) else 0)
        state = family(gauge, "keygroups_key_group_state_bytes", "Bytes of the key group's state after the latest "
                       "batch", labels)
        share = family(gauge, "keygroups_key_group_load_share", "The key group's share of the job's decayed work "
                       "(calls and timers over the last batches)", labels)
        owner = family(gauge, "keygroups_key_group_subtask", "The subtask that owned the key group in the latest "
                       "batch", labels)
        owners = m.subtask_of_key_groups()
        for kg in chosen:
            key = (job, str(int(kg)))
            state.add_metric(key, int(m.key_groups.state_bytes[kg]))
            share.add_metric(key, float(work[kg]) / total if total > 0 else 0.0)
            owner.add_metric(key, int(owners[kg]))


def _snapshot(series: JobSeries) -> dict[str, Any]:
    """A copy of ``series``'s figures, taken under the series' lock (the scrape then works without it)."""
    return {"batches": series.batches, "rescales": series.rescales, "moved_bytes": series.moved_bytes,
            "moved_key_groups": series.moved_key_groups, "timers_registered": series.timers_registered,
            "wall_seconds": series.wall_seconds, "spark_seconds": series.spark_seconds,
            "ours_seconds": series.ours_seconds, "plan_seconds": series.plan_seconds,
            "commit_seconds": series.commit_seconds, "key_groups_restored": series.key_groups_restored.copy(),
            "subtask_counts": series.subtask_counts.copy(), "subtask_seconds": series.subtask_seconds.copy(),
            "key_group_counts": series.key_group_counts.copy(), "latest": series.latest}


def serve_prometheus(port: int, *, addr: str = "0.0.0.0", key_groups: bool = False,
                     top_key_groups: int = DEFAULT_TOP_KEY_GROUPS) -> PrometheusExporter:
    """Serve this process's keygroups metrics to Prometheus on ``addr``:``port`` (``/metrics``; port 0: any free
    port, see the exporter's ``port``); see :class:`PrometheusExporter` for ``key_groups`` and ``top_key_groups``.
    Stop it with the exporter's ``stop()``."""
    return PrometheusExporter(key_groups=key_groups, top_key_groups=top_key_groups).start(port, addr)


__all__ = ["PrometheusExporter", "serve_prometheus", "DEFAULT_TOP_KEY_GROUPS"]
