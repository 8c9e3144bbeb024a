"""The keygroups command: the demo (the main job) end to end in its own process, then inspect and plan on the
checkpoints it left."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys

import pytest

from background import background_fixture
from test_raw_keyed_state import run_batch as run_raw_keyed_batch
from timer_checkpoints import run_timer_job

from keygroups import assign_to_key_group
from keygroups.checkpoint import CheckpointStorage
from keygroups.cli import demo, main
from keygroups.metrics import MetricsStore

pytestmark = pytest.mark.spark


#: How the tests run the keygroups command: this Python, which Spark's workers use too.
KEYGROUPS = (sys.executable, "-m", "keygroups")
KEYGROUPS_ENV = {"PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}


def keygroups(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([*KEYGROUPS, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **KEYGROUPS_ENV})


# The demo runs, each in its own process and directory ({dir}), started in the background when collection ends
# (tests/background.py): a demo is a minute of JVM and Python workers that needs nothing from the other tests.
demo_run = background_fixture(
    "cli_demo_run", [*KEYGROUPS, "demo", "--events", "6000", "--users", "600", "--partitions", "4", "--phases",
                     "3,1,2,5", "--batches-per-phase", "1", "--max-parallelism", "16", "--dir", "{dir}"],
    env=KEYGROUPS_ENV)
connect_demo_run = background_fixture(
    "cli_connect_demo_run", [*KEYGROUPS, "demo", "--connect", "--events", "3000", "--users", "300", "--partitions",
                             "3", "--phases", "2,1,3", "--batches-per-phase", "1", "--max-parallelism", "16",
                             "--dir", "{dir}"],
    env=KEYGROUPS_ENV)


@pytest.fixture(scope="module")
def demo_dir(cli_demo_run):
    result = cli_demo_run
    assert result.returncode == 0, result.stdout + result.stderr
    return result.directory, result


#: The start of every line the demo prints itself (the summary table's header and rows included).
DEMO_LINE = re.compile(r"keygroups demo: |  working directory |\[[1-4]/4\] |  phase \d+ p=\d+ batch \d+: chk-|"
                       r"summary$|phase +p +batches +events|\d+ +\d+ +\d+ +[\d,]+ +[\d,]+ +[\d.]+ MB$|"
                       r"restore at the start of phase |  subtask \d+: key groups |timers: |OK: all |$")


def test_demo_resumes_at_other_parallelisms_and_matches_the_reference(demo_dir):
    _, result = demo_dir
    out = result.stdout
    assert "phase 1 p=3" in out and "phase 2 p=1" in out and "phase 3 p=2" in out and "phase 4 p=5" in out
    assert "restore at the start of phase 4 (p=5)" in out
    assert "OK: all" in out and "orders equal the reference" in out
    assert re.search(r"^OK: all [\d,]+ users' state and timers, all [\d,]+ abandoned carts and all [\d,]+ orders "
                     r"equal the reference$", out, re.MULTILINE)
    # event time: some events arrive behind the watermark, and timers set in one phase fire in another (at another
    # parallelism), verified cart by cart in the batch they fired in
    timers = re.search(r"timers: ([\d,]+) carts abandoned, ([\d,]+) of them by a timer set at one parallelism that "
                       r"fired at another; ([\d,]+) late events dropped", out)
    assert timers is not None, out
    abandoned, moved, late = (int(g.replace(",", "")) for g in timers.groups())
    assert abandoned > moved > 0 and late > 0
    # only the demo's own lines: no Spark or log4j WARN lines, no JVM start-up warnings, no progress bars
    assert result.stderr == ""
    assert [line for line in out.splitlines() if not DEMO_LINE.match(line)] == []


def test_inspect_and_plan_describe_the_demo_checkpoint(demo_dir):
    workdir, _ = demo_dir
    location = str(workdir / "checkpoints")
    latest = CheckpointStorage(location).latest()
    shown = keygroups("inspect", location, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert f"checkpoint {latest.checkpoint_id} of job 'shopping-carts': parallelism 5, max parallelism 16" in shown.stdout
    assert "cart (map)" in shown.stdout and "spent (reducing)" in shown.stdout
    planned = keygroups("plan", location, "2", timeout=120)
    assert planned.returncode == 0, planned.stderr
    assert "new subtask 0 (key groups 0-7)" in planned.stdout and "new subtask 1 (key groups 8-15)" in planned.stdout
    missing = keygroups("inspect", location, "--checkpoint", "999", timeout=120)
    assert missing.returncode != 0 and "999" in missing.stderr


def test_the_dashboard_of_the_demo_shows_its_rescales_and_late_events(demo_dir, chromium):
    """``keygroups dashboard`` over the demo's checkpoints (the metrics its job kept beside them), in headless
    Chromium: every plot, no console error, the demo's three rescales (3 -> 1 -> 2 -> 5) and its late events."""
    from test_dashboard import check_plots_in_screenshot, render

    workdir, result = demo_dir
    late = int(re.search(r"([\d,]+) late events dropped", result.stdout).group(1).replace(",", ""))
    report = workdir / "report.html"
    made = keygroups("dashboard", str(workdir / "checkpoints"), "-o", str(report), timeout=120)
    assert made.returncode == 0, made.stderr
    assert f"4 batches (checkpoints 1-4), 3 rescales, {late:,} late records" in made.stdout
    page = render(chromium, report)
    assert page.errors == []
    summary = page.values["summary"]
    assert summary["rescale_checkpoints"] == [2, 3, 4] and page.values["rescale_bars"] == 3
    assert summary["records_late"] == late > 0 and page.values["late_bars"] == 4
    kept = MetricsStore(str(workdir / "checkpoints")).history()   # every batch, each rescale with its moved bytes
    assert [m.checkpoint_id for m in kept] == [1, 2, 3, 4] and [m.parallelism for m in kept] == [3, 1, 2, 5]
    assert all(m.moved_bytes > 0 for m in kept[1:]) and summary["moved_bytes"] == sum(m.moved_bytes for m in kept)
    check_plots_in_screenshot(page)


def test_verify_reports_any_difference_from_the_reference(demo_dir):
    workdir, _ = demo_dir
    storage = CheckpointStorage(str(workdir / "checkpoints"))
    expected = demo.compute_reference(demo.generate_input(6000, 600, 4, batches=4, seed=7))
    emitted = demo.Emitted(orders=list(expected.orders),
                           abandoned=[(fired, row) for _, fired, row in expected.abandoned], late=expected.late)
    assert demo.verify(storage, 16, expected, emitted) == []
    user = sorted(expected.users)[0]
    tampered = dataclasses.replace(expected, users=dict(expected.users))
    tampered.users[user] = dataclasses.replace(expected.users[user], last_seen=-1)
    problems = demo.verify(storage, 16, tampered, emitted)
    assert len(problems) == 1 and user in problems[0]
    (fired, row), *rest = emitted.abandoned
    wrong = demo.Emitted(orders=emitted.orders[1:], abandoned=[(fired + 1, row), *rest], late=emitted.late + 1)
    problems = demo.verify(storage, 16, expected, wrong)
    assert [p.split(":")[0] for p in problems] == ["orders differ", "abandoned carts differ", "late events differ"]


# ---- timers and raw keyed state offline (in process: no Spark needed) ----------------------------------------------


def test_inspect_counts_the_timers_of_a_checkpoint(tmp_path, capsys):
    storage, live = run_timer_job(str(tmp_path))
    md = storage.latest()
    assert main(["inspect", str(tmp_path), "--internal"]) == 0
    out = capsys.readouterr().out
    for domain in ("event-time", "processing-time"):
        stamps = sorted(ts for _, d, ts in live if d == domain)
        groups = {assign_to_key_group(k, md.max_parallelism) for k, d, _ in live if d == domain}
        assert f"timers ({domain}): {len(stamps):,} in {len(groups)} key groups, earliest {stamps[0]} (" in out
    assert "_timers/event-time (map)" in out   # the hidden states are listed as the keyed state they are
    assert main(["inspect", str(tmp_path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    for domain in ("event-time", "processing-time"):
        per_group: dict[str, int] = {}
        for k, d, _ in live:
            if d == domain:
                g = str(assign_to_key_group(k, md.max_parallelism))
                per_group[g] = per_group.get(g, 0) + 1
        assert shown["timers"][domain] == {"total": sum(per_group.values()), "per_key_group": per_group,
                                           "earliest": min(ts for _, d, ts in live if d == domain)}
    assert main(["inspect", str(tmp_path), "--no-timers"]) == 0
    assert "timers (" not in capsys.readouterr().out


def test_inspect_shows_and_verify_reads_raw_keyed_state(tmp_path, capsys):
    storage = CheckpointStorage(str(tmp_path))
    md, _ = run_raw_keyed_batch(storage, list(range(50)), 3)
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for h in md.raw_keyed_handles:
        assert (f"raw keyed state of subtask {h.subtask}: key groups {h.key_group_range.start}-"
                f"{h.key_group_range.end}, {h.size:,} bytes in {h.file}") in out
    assert "timers (event-time): none" in out
    assert main(["verify", str(tmp_path)]) == 0
    victim = md.raw_keyed_handles[1]
    with open(tmp_path / victim.file, "r+b") as f:
        f.seek(victim.offsets[0] + 13)
        byte = f.read(1)
        f.seek(victim.offsets[0] + 13)
        f.write(bytes([byte[0] ^ 0x40]))
    assert main(["verify", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"CORRUPT raw keyed state file {victim.file}" in err and "checksum" in err


def test_demo_over_spark_connect_matches_the_reference(cli_connect_demo_run):
    """The demo with --connect: the job runs through a Spark Connect client (no py4j gateway, no SparkContext)
    served by the demo's own local JVM, rescaled 2 -> 1 -> 3, and its state and orders equal the reference."""
    result = cli_connect_demo_run
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "over Spark Connect" in out
    assert "phase 1 p=2" in out and "phase 2 p=1" in out and "phase 3 p=3" in out
    assert "OK: all" in out and "orders equal the reference" in out
    assert result.stderr == ""
    latest = CheckpointStorage(str(result.directory / "checkpoints")).latest()
    assert (latest.parallelism, latest.max_parallelism) == (3, 16)
