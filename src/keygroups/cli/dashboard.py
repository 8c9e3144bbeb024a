"""``keygroups dashboard LOCATION -o report.html``: a job's dashboard from the metrics kept beside its checkpoints
(one self-contained HTML page, plotly.js inside: no network needed to view it; see
:mod:`keygroups.metrics.dashboard`)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from keygroups.cli.arguments import add_storage_options, whole_number


def run(args: argparse.Namespace) -> int:
    from keygroups.metrics import MetricsStore, write_dashboard
    from keygroups.metrics.store import METRICS_DIR

    try:
        import plotly  # noqa: F401
    except ImportError:
        print("keygroups dashboard: plotly is not installed; install the metrics extra: pip install "
              "'keygroups[metrics]'", file=sys.stderr)
        return 2
    store = MetricsStore(args.location, storage_options=args.storage_options)
    history = store.history(args.last)
    if not history:
        print(f"keygroups dashboard: no batch metrics in {args.location.rstrip('/')}/{METRICS_DIR}/: a KeyedJob "
              "records each batch there after its commit (unless job_metrics(job).enabled is False); is this the "
              "job's checkpoint location?", file=sys.stderr)
        return 1
    path = write_dashboard(history, args.output, title=args.title)
    rescales = sum(m.rescaled for m in history)
    print(f"{path}: {len(history)} batches (checkpoints {history[0].checkpoint_id}-{history[-1].checkpoint_id}), "
          f"{rescales} rescale{'s' if rescales != 1 else ''}, {sum(m.records_late for m in history):,} late records")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("dashboard", description=__doc__,
                       help="write a job's dashboard (key-group heat map, subtask load, rescales, late records, "
                            "state, time) as one HTML file")
    p.add_argument("location", help="the job's checkpoint location (local path or fsspec URL)")
    p.add_argument("-o", "--output", default="report.html", help="the HTML file to write (default report.html)")
    p.add_argument("--last", type=whole_number(1), default=None,
                   help="only the last N batches (default: every batch the store keeps)")
    p.add_argument("--title", default=None, help="the page's title (default: the job's name)")
    add_storage_options(p)
    p.set_defaults(run=run)
