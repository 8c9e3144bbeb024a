"""The dashboard (keygroups.metrics.dashboard) in a real browser: headless Chromium (tests/browser.py, one per test
run) loads the page from a file, and it must render every plot with no error in the console, request nothing but
the file itself, and show each plot in a screenshot. Batches come from the test harness (the subtask code a job
runs) with late records, timers and two rescales; the demo's own dashboard is checked in tests/test_cli.py."""

from __future__ import annotations

import io
import json
import uuid
from datetime import timedelta

import numpy as np
import pyarrow as pa
import pytest

from keygroups.cli import main
from keygroups.metrics import job_metrics, write_dashboard
from keygroups.metrics.dashboard import MAX_HEAT_MAP_ROWS, PLOTS, _heat_map
from keygroups.runtime import KeyedProcessFunction, WatermarkStrategy
from keygroups.serializers import Int64Serializer
from keygroups.state import ValueStateDescriptor
from keygroups.testing import KeyedFunctionHarness

Image = pytest.importorskip("PIL.Image")


class Count(KeyedProcessFunction):
    def open(self, context):
        self.count = context.get_state(ValueStateDescriptor("count", Int64Serializer()))

    def process_element(self, record, context):
        n = (self.count.value() or 0) + 1
        self.count.update(n)
        context.timer_service.register_event_time_timer(context.timestamp + 500)
        return [(context.current_key, n)]


def job_history(max_parallelism=32, phases=((2, 3), (4, 2), (1, 2))):
    """The metrics of a harness job's batches over ``phases`` (parallelism, batches), restored from a snapshot at
    each new parallelism; a skewed input, a few late records per batch."""
    name = f"dashboard-{uuid.uuid4().hex[:8]}"
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(timedelta(milliseconds=10))
    h = KeyedFunctionHarness(Count(), "k", output_schema="k long, n long", max_parallelism=max_parallelism,
                             parallelism=phases[0][0], timestamp_column="t", watermark_strategy=strategy, name=name)
    harnesses, history, stamp = [h], [], 0
    rng = np.random.default_rng(5)
    try:
        for parallelism, batches in phases:
            if parallelism != h.parallelism:
                h = h.restore(h.snapshot(), parallelism=parallelism)
                harnesses.append(h)
            recorder = job_metrics(h)
            for _ in range(batches):
                keys = rng.zipf(1.5, 300).astype(np.int64) % 500
                stamps = stamp + np.arange(len(keys))
                if stamp:
                    stamps[:5] = 0   # late: behind the watermark the batch starts with
                stamp += len(keys) + 1000
                h.process(pa.table({"k": keys, "t": stamps}))
                history.append(recorder.latest)
    finally:
        for x in harnesses:
            x.close()
    return history


@pytest.fixture(scope="module")
def history():
    return job_history()


def _hex(color):
    return tuple(int(color[i:i + 2], 16) for i in (1, 3, 5))


def _over_white(color, opacity):
    return tuple(round(opacity * c + (1 - opacity) * 255) for c in _hex(color))


#: A color each plot draws its data in (None: the heat map, whose colors follow the data).
EXPECTED_COLORS = {"heat-map": None, "subtask-load": _hex("#2e86de"), "rescales": _over_white("#f39c12", 0.7),
                   "late-records": _hex("#c0392b"), "state-growth": _hex("#2e86de"), "batch-time": _hex("#17bebb")}

RECTS = ("Object.fromEntries([...document.querySelectorAll('.plotly-graph-div')].map(e => {"
         "const r = e.getBoundingClientRect(); return [e.id, [r.left + window.scrollX, r.top + window.scrollY, "
         "r.width, r.height]]}))")
READY = ("[...document.querySelectorAll('.plotly-graph-div')].length === %d && "
         "[...document.querySelectorAll('.plotly-graph-div')].every(e => e.querySelector('.cartesianlayer .trace'))")


def render(chromium, path):
    return chromium.render(path.as_uri(), ready=READY % len(PLOTS), expressions={
        "rects": RECTS,
        "summary": "JSON.parse(document.getElementById('keygroups-summary').textContent)",
        "heat_map_images": "document.querySelectorAll('#heat-map .hm image').length",
        "rescale_bars": "document.querySelectorAll('#rescales .bars .point').length",
        "late_bars": "document.querySelectorAll('#late-records .bars .point').length",
        "title": "document.title",
        "external": "document.querySelectorAll('script[src], link[href], img[src], iframe').length",
    })


def check_plots_in_screenshot(page, save_to=None):
    """Every plot's area of the screenshot is drawn on (not blank), in the colors its data is drawn in."""
    if save_to is not None:
        save_to.write_bytes(page.screenshot)
    shot = np.asarray(Image.open(io.BytesIO(page.screenshot)).convert("RGB")).astype(np.int16)
    for plot in PLOTS:
        left, top, width, height = (int(round(v)) for v in page.values["rects"][plot])
        assert width > 300 and height > 300, (plot, width, height)
        area = shot[top:top + height, left:left + width].reshape(-1, 3)
        drawn = (area < 235).any(axis=1).mean()
        assert drawn > 0.01, f"{plot}: only {drawn:.1%} of its area is drawn on"
        expected = EXPECTED_COLORS[plot]
        if expected is None:
            colors = {tuple(c) for c in (area[(area < 235).any(axis=1)] // 16).tolist()}
            assert len(colors) >= 8, f"{plot}: {len(colors)} colors"
        else:
            near = (np.abs(area - np.asarray(expected)).max(axis=1) <= 10).sum()
            assert near >= 50, f"{plot}: {near} pixels of its data color {expected}"


def test_the_dashboard_renders_every_plot_with_no_error_and_no_network(history, chromium, tmp_path):
    rescales = [m.checkpoint_id for m in history if m.rescaled]
    late = sum(m.records_late for m in history)
    assert len(rescales) == 2 and late > 0 and sum(m.timers_fired for m in history) > 0
    path = tmp_path / "report.html"
    write_dashboard(history, path)
    page = render(chromium, path)
    assert page.errors == []
    assert page.values["external"] == 0   # plotly.js is inside the page
    assert page.requests and all(u.startswith(("file:", "data:", "about:")) for u in page.requests), page.requests
    summary = page.values["summary"]
    assert summary["rescales"] == 2 and summary["rescale_checkpoints"] == rescales
    assert summary["records_late"] == late and summary["batches"] == len(history)
    assert summary["moved_bytes"] == sum(m.moved_bytes for m in history) > 0
    assert page.values["heat_map_images"] == 1
    assert page.values["rescale_bars"] == 2 and page.values["late_bars"] == len(history)
    assert history[0].job in page.values["title"]
    check_plots_in_screenshot(page, tmp_path / "screenshot.png")


def test_the_heat_map_sums_key_groups_into_rows_beyond_its_limit():
    go = pytest.importorskip("plotly.graph_objects")
    history = job_history(max_parallelism=2048, phases=((2, 2),))
    z = np.asarray(_heat_map(history, go).data[0].z, dtype=float)
    assert z.shape == (MAX_HEAT_MAP_ROWS, 2)
    assert np.array_equal(z.sum(axis=0), [m.records_in - m.records_late for m in history])
    assert np.array_equal(z[:, 0], history[0].key_groups.records.reshape(MAX_HEAT_MAP_ROWS, 4).sum(axis=1))


def test_the_dashboard_command_writes_the_page_or_says_why_not(history, tmp_path, capsys):
    empty = tmp_path / "no-job"
    assert main(["dashboard", str(empty), "-o", str(tmp_path / "x.html")]) == 1
    assert "no batch metrics in" in capsys.readouterr().err
    assert not (tmp_path / "x.html").exists()
    # a location whose job recorded batches
    from keygroups.metrics import MetricsStore

    store = MetricsStore(tmp_path / "job", keep=len(history))
    for m in history:
        store.write(m)
    out = tmp_path / "report.html"
    assert main(["dashboard", str(tmp_path / "job"), "-o", str(out), "--last", "4"]) == 0
    printed = capsys.readouterr().out
    assert f"{out}: 4 batches" in printed
    summary = json.loads(out.read_text(encoding="utf-8").split('id="keygroups-summary">', 1)[1].split("</script>")[0])
    assert summary["batches"] == 4 and summary["last_checkpoint"] == history[-1].checkpoint_id
