"""``keygroups inspect DIR --plot out.png|.svg|.html [--parallelism P] [--keys]``: a checkpoint in pictures.

Four panels: bytes per key group (each chain's full block and deltas; the subtasks' boundaries marked), keys per key
group (with ``--keys``, which reads every block), the load of each subtask at the checkpoint's parallelism and at a
proposed one with its skew (max over mean), and the state's size over the retained checkpoints. ``.html`` is one
self-contained file: a summary table and the picture as inline SVG (no script, nothing fetched).

Drawing needs matplotlib, an optional extra (``pip install 'keygroups[plot]'``), imported only when a picture is
drawn; the figures themselves are :mod:`keygroups.checkpoint.stats`'s and need nothing more.
"""

from __future__ import annotations

import argparse
import html
import io
import os
import sys
from collections.abc import Sequence
from typing import Any

from keygroups import key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.checkpoint.stats import CheckpointFigures, checkpoint_figures, size_history, skew
from keygroups.cli.arguments import whole_number

#: The picture formats ``--plot`` writes, by file extension.
FORMATS = (".png", ".svg", ".html")
#: Marking every subtask boundary stops helping past this many subtasks.
_MAX_MARKED_SUBTASKS = 64
_MISSING = ("drawing a checkpoint needs matplotlib, which is not installed: install the plot extra, "
            "pip install 'keygroups[plot]'")


def plot_path(text: str) -> str:
    """An argparse type: a file to write, ending in one of :data:`FORMATS`, in a directory that exists."""
    extension = os.path.splitext(text)[1].lower()
    if extension not in FORMATS:
        raise argparse.ArgumentTypeError(f"{text!r} does not end in {', '.join(FORMATS)}: the extension chooses the "
                                         f"picture's format")
    directory = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"the directory {directory!r} of {text!r} does not exist")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The picture and skew options of ``keygroups inspect``."""
    parser.add_argument("--plot", type=plot_path, metavar="OUT",
                        help=f"draw the checkpoint to OUT ({', '.join(FORMATS)}; needs pip install "
                             "'keygroups[plot]')")
    parser.add_argument("--parallelism", type=whole_number(1), metavar="P",
                        help="also show each subtask's load and the skew (max/mean) at parallelism P")
    parser.add_argument("--keys", action="store_true",
                        help="count keys per key group too: reads every block of the state once (what a restore "
                             "reads), decoding no value")


def _matplotlib_figure() -> Any:
    """matplotlib's Figure class (no pyplot: no global state, no GUI backend), or ImportError naming the extra."""
    try:
        from matplotlib.figure import Figure   # the optional extra: imported only when a picture is drawn
    except ImportError as e:
        raise ImportError(_MISSING) from e
    return Figure


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _load_panel(ax: Any, figures: CheckpointFigures, parallelism: int, label: str) -> None:
    loads = figures.loads(parallelism)
    mean = sum(loads) / parallelism
    ax.bar(range(parallelism), loads, width=1.0 if parallelism > _MAX_MARKED_SUBTASKS else 0.8, color="tab:blue")
    ax.axhline(mean, color="black", linestyle="--", linewidth=1, label=f"mean {_size(mean)}")
    title = f"{label} p={parallelism}: skew {skew(loads):.2f} (bytes)"
    if figures.keys is not None:
        title += f", {figures.skew(parallelism, 'keys'):.2f} (keys)"
    ax.set_title(title)
    if parallelism <= 32:
        ax.set_xticks(range(parallelism))
    ax.set_xlabel("subtask")
    ax.set_ylabel("bytes of keyed state")
    ax.legend(loc="lower right", fontsize="small")


def _mark_subtasks(ax: Any, max_parallelism: int, parallelism: int, style: str, label: str) -> None:
    """Vertical lines where one subtask's key groups end and the next one's begin."""
    if parallelism > _MAX_MARKED_SUBTASKS or parallelism == 1:
        return
    for j in range(1, parallelism):
        start = key_group_range(max_parallelism, parallelism, j).start
        ax.axvline(start, color="gray", linestyle=style, linewidth=0.8, label=label if j == 1 else None)


def draw(figures: CheckpointFigures, history: Sequence[CheckpointFigures], proposed: int | None = None) -> Any:
    """A matplotlib Figure of ``figures`` (bytes and, if counted, keys per key group; loads at the checkpoint's
    parallelism and at ``proposed``) and ``history`` (state size per retained checkpoint)."""
    Figure = _matplotlib_figure()
    mp, p = figures.max_parallelism, figures.parallelism
    rows = [["bytes", "bytes"]]
    if figures.keys is not None:
        rows.append(["keys", "keys"])
    rows.append(["current", "proposed"] if proposed is not None else ["current", "current"])
    rows.append(["history", "history"])
    fig = Figure(figsize=(11, 3.2 * len(rows)), layout="constrained")
    fig.suptitle(f"checkpoint {figures.checkpoint_id} of job {figures.job_id!r}: parallelism {p}, max parallelism "
                 f"{mp}, {_size(figures.keyed_bytes)} of keyed state")
    axes = fig.subplot_mosaic(rows)
    edges = range(mp + 1)
    ax = axes["bytes"]
    ax.stairs(figures.bytes_per_key_group, edges, fill=True, color="tab:orange", label="deltas")
    ax.stairs(figures.full_bytes, edges, fill=True, color="tab:blue", label="full blocks")
    _mark_subtasks(ax, mp, p, ":", f"subtasks at p={p}")
    if proposed is not None and proposed != p:
        _mark_subtasks(ax, mp, proposed, "--", f"subtasks at p={proposed}")
    ax.set_title("bytes per key group (what restoring it reads)")
    ax.set_xlabel("key group")
    ax.set_ylabel("bytes")
    ax.set_xlim(0, mp)
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1), fontsize="small")
    if figures.keys is not None:
        ax = axes["keys"]
        ax.stairs(figures.keys, edges, fill=True, color="tab:green")
        ax.set_title(f"keys per key group ({sum(figures.keys):,} keys)")
        ax.set_xlabel("key group")
        ax.set_ylabel("keys")
        ax.set_xlim(0, mp)
    _load_panel(axes["current"], figures, p, "current")
    if proposed is not None:
        _load_panel(axes["proposed"], figures, proposed, "proposed")
    ax = axes["history"]
    ids = [h.checkpoint_id for h in history]
    ax.plot(ids, [h.keyed_bytes for h in history], marker="o", label="keyed state (chains)")
    ax.plot(ids, [h.operator_bytes for h in history], marker="s", label="operator state")
    ax.plot(ids, [h.written_bytes for h in history], marker="^", linestyle="--", label="written by the checkpoint")
    for h in history:
        ax.annotate(f"p={h.parallelism}", (h.checkpoint_id, h.keyed_bytes), textcoords="offset points",
                    xytext=(0, 6), ha="center", fontsize="small")
    ax.set_title(f"state size over the {len(history)} retained checkpoints")
    ax.set_xlabel("checkpoint")
    ax.set_ylabel("bytes")
    ax.set_xticks(ids)
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", bbox_to_anchor=(1, 1), fontsize="small")
    return fig


def _html(figures: CheckpointFigures, proposed: int | None, svg: str) -> str:
    rows = []
    for label, p in [("current", figures.parallelism)] + ([("proposed", proposed)] if proposed is not None else []):
        loads = figures.loads(p)
        keys = f"{figures.skew(p, 'keys'):.2f}" if figures.keys is not None else "not counted (--keys)"
        rows.append(f"<tr><td>{label}</td><td>{p}</td><td>{skew(loads):.2f}</td><td>{keys}</td>"
                    f"<td>{_size(max(loads))}</td><td>{_size(sum(loads) / p)}</td></tr>")
    title = html.escape(f"keygroups: checkpoint {figures.checkpoint_id} of job {figures.job_id!r}")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{title}</title>
<style>body {{ font-family: sans-serif; margin: 2em; }} table {{ border-collapse: collapse; }}
td, th {{ border: 1px solid #999; padding: 0.2em 0.6em; text-align: right; }} svg {{ max-width: 100%; height: auto; }}
</style>
</head>
<body>
<h1>{title}</h1>
<p>max parallelism {figures.max_parallelism}, {_size(figures.keyed_bytes)} of keyed state,
{_size(figures.operator_bytes)} of operator state; this checkpoint wrote {_size(figures.written_bytes)}.</p>
<table>
<tr><th></th><th>parallelism</th><th>skew (bytes)</th><th>skew (keys)</th><th>largest subtask</th><th>mean</th></tr>
{chr(10).join(rows)}
</table>
{svg}
</body>
</html>
"""


def save_plot(path: str, figures: CheckpointFigures, history: Sequence[CheckpointFigures],
              proposed: int | None = None) -> None:
    """Draw (:func:`draw`) and write to ``path``: ``.png``, ``.svg``, or ``.html`` (self-contained: the summary
    table and the picture as inline SVG)."""
    extension = os.path.splitext(path)[1].lower()
    if extension not in FORMATS:
        raise ValueError(f"{path!r} does not end in {', '.join(FORMATS)}: the extension chooses the picture's format")
    fig = draw(figures, history, proposed)
    if extension != ".html":
        fig.savefig(path, format=extension[1:], dpi=100)
        return
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg")
    svg = buffer.getvalue()
    with open(path, "w", encoding="utf-8") as f:
        f.write(_html(figures, proposed, svg[svg.index("<svg"):]))


def run(args: argparse.Namespace, storage: CheckpointStorage, metadata: CheckpointMetadata) -> int:
    """The ``--plot``/``--parallelism``/``--keys`` part of ``keygroups inspect``, after the description: print the
    loads and skew (unless ``--json``), write the picture. Exit status 2 with one line for a parallelism above the
    checkpoint's max parallelism or a missing matplotlib."""
    proposed = args.parallelism
    if proposed is None and not args.plot and not args.keys:
        return 0
    if proposed is not None and proposed > metadata.max_parallelism:
        print(f"keygroups inspect: --parallelism {proposed} is above checkpoint {metadata.checkpoint_id}'s max "
              f"parallelism {metadata.max_parallelism}; give a parallelism from 1 to {metadata.max_parallelism}",
              file=sys.stderr)
        return 2
    if args.plot:
        try:
            _matplotlib_figure()   # before reading any state
        except ImportError as e:
            print(f"keygroups inspect: {e}", file=sys.stderr)
            return 2
    figures = checkpoint_figures(storage, metadata, with_keys=args.keys)
    if not args.json:
        measures = ["bytes"] + (["keys"] if figures.keys is not None else [])
        for p in dict.fromkeys([metadata.parallelism] + ([proposed] if proposed is not None else [])):
            shown = "; ".join(f"{m} skew {figures.skew(p, m):.2f} (largest {max(figures.loads(p, m)):,}, mean "
                              f"{sum(figures.loads(p, m)) / p:,.1f})" for m in measures)
            print(f"load per subtask at p={p}: {shown}")
        if figures.keys is not None:
            print(f"keys: {sum(figures.keys):,} in {sum(1 for k in figures.keys if k)} of {len(figures.keys)} key "
                  f"groups")
    if args.plot:
        save_plot(args.plot, figures, size_history(storage), proposed)
        if not args.json:
            print(f"picture written to {args.plot}")
    return 0
