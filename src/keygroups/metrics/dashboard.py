"""A job's dashboard as one self-contained HTML page: :func:`dashboard_html`, :func:`write_dashboard`
(``keygroups dashboard LOCATION -o report.html``).

Drawn with plotly, whose JavaScript is written into the page itself: the file opens in any browser with no network
(about 5 MB, most of it plotly.js). From the batches a :class:`~keygroups.metrics.MetricsStore` keeps, six plots:

1. the key-group heat map: records per key group, batch after batch, with each batch's range boundaries drawn over
   it (key groups are summed into at most :data:`MAX_HEAT_MAP_ROWS` rows when there are more);
2. each subtask's load against its range in the latest batch: its share of the key groups beside its share of the
   batch's records, of the decayed work and of the state;
3. the rescale history: parallelism batch after batch, each rescale marked with the bytes it moved and the
   assignment's reason;
4. late records per batch beside the records in;
5. state growth: state bytes and entries after each batch;
6. each batch's time on the driver split into Spark's own jobs and ours (the rest), with our phases in its hover.
"""

from __future__ import annotations

import html
import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from keygroups.metrics.model import BatchMetrics

#: The heat map sums key groups into at most this many rows.
MAX_HEAT_MAP_ROWS = 512
#: Each plot's id in the page, in the order they are drawn.
PLOTS = ("heat-map", "subtask-load", "rescales", "late-records", "state-growth", "batch-time")
_HEIGHT = 440
_COLORS = {"spark": "#e4572e", "ours": "#17bebb", "late": "#c0392b", "records": "#7f8c8d", "bytes": "#2e86de",
           "entries": "#8e44ad", "parallelism": "#2c3e50", "moved": "#f39c12"}


def _label(m: BatchMetrics) -> str:
    return f"chk {m.checkpoint_id}"


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


def _heat_map(history: Sequence[BatchMetrics], go: Any) -> Any:
    mp = max(m.max_parallelism for m in history)
    width = max(1, -(-mp // MAX_HEAT_MAP_ROWS))   # key groups per row
    rows = -(-mp // width)
    z = np.full((rows, len(history)), np.nan)
    for j, m in enumerate(history):
        records = m.key_groups.records.astype(np.float64)
        padded = np.zeros(rows * width)
        padded[:len(records)] = records
        z[:, j] = padded.reshape(rows, width).sum(axis=1)
        if m.max_parallelism < mp:   # a batch of fewer key groups: its rows past them hold nothing
            z[-(-m.max_parallelism // width):, j] = np.nan
    x = [_label(m) for m in history]
    per_row = "key group" if width == 1 else f"key groups (rows of {width})"
    fig = go.Figure(go.Heatmap(z=z, x=x, y0=0, dy=width, colorscale="Viridis", colorbar={"title": "records"},
                               hovertemplate="%{x}<br>key group %{y}: %{z:,.0f} records<extra></extra>"))
    bx, by = [], []
    for m in history:
        for b in m.boundaries[1:-1]:
            bx.append(_label(m))
            by.append(b - 0.5)
    fig.add_trace(go.Scatter(x=bx, y=by, mode="markers", name="range boundary",
                             marker={"symbol": "line-ew-open", "size": 14, "line": {"width": 2, "color": "white"}},
                             hovertemplate="%{x}: a range starts at key group %{y:.0f}<extra></extra>"))
    fig.update_layout(title=f"Records per key group, batch after batch ({mp} key groups; white: range boundaries)",
                      xaxis_title="batch (checkpoint)", yaxis_title=per_row, showlegend=False)
    fig.update_yaxes(range=[-0.5, mp - 0.5])
    return fig


def _subtask_load(m: BatchMetrics, go: Any) -> Any:
    b = np.asarray(m.boundaries, dtype=np.int64)
    starts = b[:-1]

    def share(values: Any) -> Any:
        sums = np.add.reduceat(np.asarray(values, dtype=np.float64), starts)
        total = sums.sum()
        return sums / total if total > 0 else np.zeros(len(sums))

    names = [f"{i}: {b[i]}–{b[i + 1] - 1}" for i in range(m.parallelism)]
    fig = go.Figure()
    for label, values, color in (("key groups (its range)", np.ones(m.max_parallelism), "#bdc3c7"),
                                 ("records this batch", m.key_groups.records, _COLORS["bytes"]),
                                 ("decayed work", m.key_groups.decayed_work, _COLORS["moved"]),
                                 ("state bytes", m.key_groups.state_bytes, _COLORS["entries"])):
        fig.add_trace(go.Bar(x=names, y=share(values), name=label, marker_color=color,
                             hovertemplate="subtask %{x}: %{y:.1%} of the " + label + "<extra></extra>"))
    fig.add_hline(y=1 / m.parallelism, line_dash="dot", annotation_text="an even share")
    balance = "" if m.max_over_mean is None else f"; largest load / mean {m.max_over_mean:.2f}"
    fig.update_layout(title=f"Each subtask's load against its range ({_label(m)}, {m.assignment or 'flink'} "
                            f"ranges{balance})", barmode="group", xaxis_title="subtask: its key groups",
                      yaxis_title="share", yaxis_tickformat=".0%")
    return fig


def _rescales(history: Sequence[BatchMetrics], go: Any) -> Any:
    x = [_label(m) for m in history]
    rescales = [m for m in history if m.rescaled]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=[m.parallelism for m in history], name="parallelism", mode="lines+markers",
                             line={"shape": "hv", "color": _COLORS["parallelism"]},
                             hovertemplate="%{x}: parallelism %{y}<extra></extra>"))
    hover = []
    for m in rescales:
        reason = (m.decision or {}).get("reason", "")
        hover.append(html.escape(f"{_label(m)}: parallelism {m.previous_parallelism} -> {m.parallelism}, "
                                 f"max parallelism {m.previous_max_parallelism} -> {m.max_parallelism}; "
                                 f"{m.moved_key_groups} key groups moved ({_mb(m.moved_bytes)}); {reason}"))
    fig.add_trace(go.Bar(x=[_label(m) for m in rescales], y=[m.moved_bytes / 1e6 for m in rescales],
                         name="moved (MB)", yaxis="y2", marker_color=_COLORS["moved"], opacity=0.7,
                         hovertext=hover, hoverinfo="text"))
    moved = sum(m.moved_bytes for m in rescales)
    fig.update_layout(title=f"Rescales: {len(rescales)} ({_mb(moved)} of state moved between subtasks)",
                      xaxis_title="batch (checkpoint)", yaxis={"title": "parallelism", "rangemode": "tozero"},
                      yaxis2={"title": "state moved (MB)", "overlaying": "y", "side": "right",
                              "rangemode": "tozero"})
    return fig


def _late(history: Sequence[BatchMetrics], go: Any) -> Any:
    x = [_label(m) for m in history]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=x, y=[m.records_late for m in history], name="late records",
                         marker_color=_COLORS["late"],
                         customdata=[f"{m.late_share:.2%}" for m in history],
                         hovertemplate="%{x}: %{y:,} late (%{customdata} of the batch)<extra></extra>"))
    fig.add_trace(go.Scatter(x=x, y=[m.records_in for m in history], name="records in", yaxis="y2",
                             mode="lines+markers", line={"color": _COLORS["records"]},
                             hovertemplate="%{x}: %{y:,} records in<extra></extra>"))
    late = sum(m.records_late for m in history)
    fig.update_layout(title=f"Late records: {late:,} in all (at or before the watermark the batch started with)",
                      xaxis_title="batch (checkpoint)", yaxis={"title": "late records", "rangemode": "tozero"},
                      yaxis2={"title": "records in", "overlaying": "y", "side": "right", "rangemode": "tozero"})
    return fig


def _state(history: Sequence[BatchMetrics], go: Any) -> Any:
    x = [_label(m) for m in history]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=x, y=[m.state_bytes / 1e6 for m in history], name="state (MB)",
                             mode="lines+markers", line={"color": _COLORS["bytes"]},
                             hovertemplate="%{x}: %{y:,.2f} MB of state<extra></extra>"))
    fig.add_trace(go.Scatter(x=x, y=[m.state_entries for m in history], name="state entries", yaxis="y2",
                             mode="lines+markers", line={"color": _COLORS["entries"], "dash": "dot"},
                             hovertemplate="%{x}: %{y:,} entries<extra></extra>"))
    fig.update_layout(title="State growth (after each batch: the bytes a full restore reads, and the entries)",
                      xaxis_title="batch (checkpoint)", yaxis={"title": "state (MB)", "rangemode": "tozero"},
                      yaxis2={"title": "entries", "overlaying": "y", "side": "right", "rangemode": "tozero"})
    return fig


def _time(history: Sequence[BatchMetrics], go: Any) -> Any:
    x = [_label(m) for m in history]

    def phases(m: BatchMetrics) -> str:
        slowest = max(m.subtasks, key=lambda s: s.ours_seconds, default=None)
        inside = "" if slowest is None else (
            f"<br>slowest subtask {slowest.subtask}: restore {slowest.restore_seconds:.3f}, prepare "
            f"{slowest.prepare_seconds:.3f}, process {slowest.process_seconds:.3f}, timers "
            f"{slowest.timers_seconds:.3f}, snapshot {slowest.snapshot_seconds:.3f} s"
            + ("" if slowest.spark_task_seconds is None else f"; its Spark task {slowest.spark_task_seconds:.3f} s"))
        return f"plan {m.plan_seconds:.3f} s, commit {m.commit_seconds:.3f} s{inside}"

    spark = [m.spark_seconds for m in history]
    ours = [m.ours_seconds if m.ours_seconds is not None else m.wall_seconds for m in history]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=x, y=spark, name="Spark's jobs", marker_color=_COLORS["spark"],
                         hovertemplate="%{x}: Spark's jobs %{y:.3f} s<extra></extra>"))
    fig.add_trace(go.Bar(x=x, y=ours, name="ours (the rest of the batch on the driver)",
                         marker_color=_COLORS["ours"], customdata=[phases(m) for m in history],
                         hovertemplate="%{x}: ours %{y:.3f} s<br>%{customdata}<extra></extra>"))
    known = [m for m in history if m.spark_seconds is not None and m.wall_seconds]
    share = (f": ours {sum(m.ours_seconds or 0.0 for m in known) / sum(m.wall_seconds or 0.0 for m in known):.0%}"
             if known else " (Spark's part unknown: no Spark status store)")
    fig.update_layout(title=f"Each batch's time: Spark's own jobs and ours{share}", barmode="stack",
                      xaxis_title="batch (checkpoint)", yaxis_title="seconds")
    return fig


def dashboard_html(history: Sequence[BatchMetrics], *, title: str | None = None) -> str:
    """The dashboard of ``history`` (a job's batches, oldest first) as one HTML page with plotly.js inside (see
    the module docs). ValueError when ``history`` is empty."""
    import plotly.graph_objects as go
    import plotly.offline

    if not history:
        raise ValueError("no batches to draw: the metrics store is empty (a job records each batch after its commit; "
                         "the test harness once asked with job_metrics(harness))")
    history = sorted(history, key=lambda m: m.checkpoint_id)
    latest = history[-1]
    figures = [_heat_map(history, go), _subtask_load(latest, go), _rescales(history, go), _late(history, go),
               _state(history, go), _time(history, go)]
    sections = []
    for plot_id, fig in zip(PLOTS, figures):
        fig.update_layout(template="plotly_white", height=_HEIGHT, margin={"t": 60, "r": 60, "l": 70, "b": 60},
                          legend={"orientation": "h", "y": -0.2})
        body = fig.to_html(include_plotlyjs=False, full_html=False, div_id=plot_id, default_height=f"{_HEIGHT}px",
                           config={"displaylogo": False, "responsive": True})
        sections.append(f'<section class="plot">{body}</section>')
    jobs = sorted({m.job for m in history})
    heading = title or f"keygroups job {', '.join(jobs)}"
    rescales = sum(m.rescaled for m in history)
    facts = [f"{len(history)} batches (checkpoints {history[0].checkpoint_id}–{latest.checkpoint_id})",
             f"max parallelism {latest.max_parallelism}, parallelism {latest.parallelism} now",
             f"{rescales} rescale{'s' if rescales != 1 else ''}",
             f"{sum(m.records_in for m in history):,} records in, {sum(m.records_late for m in history):,} late",
             f"state {_mb(latest.state_bytes)}"]
    summary = json.dumps({"job": jobs, "batches": len(history), "first_checkpoint": history[0].checkpoint_id,
                          "last_checkpoint": latest.checkpoint_id, "rescales": rescales,
                          "rescale_checkpoints": [m.checkpoint_id for m in history if m.rescaled],
                          "moved_bytes": sum(m.moved_bytes for m in history),
                          "records_late": sum(m.records_late for m in history), "plots": list(PLOTS)}
                         ).replace("<", "\\u003c")   # raw text in <script>: no "</script>" can end it early
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{html.escape(heading)}</title>"
        "<style>body{font-family:system-ui,sans-serif;margin:1.5em auto;max-width:1200px;color:#222}"
        "h1{font-size:1.4em}ul.facts{color:#555}section.plot{margin:1em 0 2em 0}</style>"
        f"<script type=\"text/javascript\">{plotly.offline.get_plotlyjs()}</script>"
        f"<script type=\"application/json\" id=\"keygroups-summary\">{summary}</script>"
        f"</head><body><h1>{html.escape(heading)}</h1><ul class=\"facts\">"
        + "".join(f"<li>{html.escape(f)}</li>" for f in facts)
        + "</ul>" + "".join(sections) + "</body></html>\n")


def write_dashboard(history: Sequence[BatchMetrics], path: str | os.PathLike[str], *,
                    title: str | None = None) -> str:
    """Write :func:`dashboard_html` of ``history`` to ``path`` (written whole, then renamed into place); returns
    the path."""
    out = os.fspath(path)
    text = dashboard_html(history, title=title)
    tmp = f"{out}.inprogress-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, out)
    return out


__all__ = ["dashboard_html", "write_dashboard", "PLOTS", "MAX_HEAT_MAP_ROWS"]
