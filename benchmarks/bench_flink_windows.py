"""Flink window state in and out: keygroups' export and import of a window operator's state (``window-contents`` in
``TimeWindow`` namespaces and the window timers, keygroups.flink.windows) beside Flink restoring the same savepoint
and firing its windows, in one run.

    python benchmarks/bench_flink_windows.py [--keys 200000] [--windows 2] [--runs 3] [--parallelism 2]

A keygroups ``window(TumblingEventTimeWindows.of(10 s)).reduce(...)`` job (run by ``KeyedFunctionHarness``) holds
``--windows`` open windows for each of ``--keys`` Long keys: one reduced Long per window and a timer at its end.
Then, medians of ``--runs`` interleaved runs:

* keygroups export: ``export_savepoint`` of that state as a Flink savepoint of a ``WindowOperator`` (uid "window");
* keygroups import: ``import_savepoint`` of the Flink savepoint back into keygroups' window operator layout;
* Flink restore + fire: the net runtime of a Flink 2.3 job (tests/flink/SavepointJob.java ``windows``) that
  restores the savepoint at ``--parallelism``, fires every window at the end of its input and ends, minus the net
  runtime of the keyed job restoring nothing (start-up subtracted). Flink also fires the windows here (there is no
  watermark-free way to end a job with its windows restored), so its figure is an upper bound of its restore.

Throughput is the Flink savepoint's bytes per second per core (keygroups runs on one core; Flink's figure is divided
by its subtasks). keygroups' window state and window timers go through the compiled paths (_native/flinkin.pyx
imports, _native/flinkout.pyx exports; the Python path of keygroups.flink.windows stays for sessions and a process
window's records); the issue's target is 50 MB/s per core both ways.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import flink_harness  # noqa: E402

from keygroups.flink import export_savepoint, import_savepoint  # noqa: E402
from keygroups.flink.windows import FlinkWindows  # noqa: E402
from keygroups.serializers import Int64Serializer  # noqa: E402
from keygroups.testing import KeyedFunctionHarness  # noqa: E402
from keygroups.windows import TumblingEventTimeWindows, window  # noqa: E402

SIZE = 10_000


def add(a: int, b: int) -> int:
    return a + b


def _size(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _flink_fire_ms(savepoint: pathlib.Path, parallelism: int, out: pathlib.Path) -> tuple[int, int]:
    """Flink's net runtime (ms) restoring ``savepoint`` and firing its windows, and how many it fired."""
    r = flink_harness._run(["windows", savepoint, parallelism, "long", out])
    if r.returncode != 0:
        raise RuntimeError(f"the Flink window job failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("fired "))
    return int(line.split("netRuntimeMs=")[1]), int(line.split()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=200_000)
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--parallelism", type=int, default=2)
    args = ap.parse_args()

    schema = pa.schema([("k", pa.int64()), ("t", pa.int64()), ("n", pa.int64())])
    job = window(TumblingEventTimeWindows.of(SIZE), input_schema=schema, key_columns="k",
                 timestamp_column="t").reduce(add, "n", Int64Serializer())
    harness = KeyedFunctionHarness(job.function, "k", output_schema=job.output_schema, input_schema=schema,
                                   timestamp_column="t", parallelism=args.parallelism)
    keys = np.repeat(np.arange(args.keys, dtype=np.int64) * 7919, args.windows)
    times = np.tile(np.arange(args.windows, dtype=np.int64) * SIZE, args.keys)
    t = time.perf_counter()
    harness.process(pa.table({"k": keys, "t": times, "n": keys % 1000}, schema=schema))
    snapshot = harness.snapshot()
    windows = args.keys * args.windows
    print(f"keygroups window state: {args.keys} keys x {args.windows} windows (built in "
          f"{time.perf_counter() - t:.1f} s), parallelism {args.parallelism}, max parallelism 128; "
          f"load {os.getloadavg()}")

    exports, imports, flink = [], [], []
    size = 0
    for run in range(args.runs):
        work = pathlib.Path(tempfile.mkdtemp(prefix="keygroups-bench-flink-windows-"))
        try:
            t = time.perf_counter()
            export_savepoint(snapshot.location, work / "flink", uid="window", savepoint=snapshot.name,
                             windows=FlinkWindows())
            exports.append(time.perf_counter() - t)
            size = _size(work / "flink")
            t = time.perf_counter()
            report = import_savepoint(work / "flink", str(work / "loc"), "w", uid="window")
            imports.append(time.perf_counter() - t)
            assert report.entries == windows and report.timers == windows, report
            base = flink_harness.restore_runtime_ms(None, args.parallelism, "long", "hashmap")
            full, fired = _flink_fire_ms(work / "flink", args.parallelism, work / "fired.txt")
            assert fired == windows, f"Flink fired {fired} of {windows} windows"
            flink.append(max(full - base, 1) / 1000)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f"run {run + 1}: export {exports[-1]:.2f} s, import {imports[-1]:.2f} s, Flink restore + fire "
              f"{flink[-1]:.2f} s ({full} ms - {base} ms restoring nothing); load {os.getloadavg()}")

    exp, imp, fl = (statistics.median(x) for x in (exports, imports, flink))
    rows = [("keygroups export (1 core)", exp, size / exp / 1e6),
            ("keygroups import (1 core)", imp, size / imp / 1e6),
            (f"Flink restore + fire ({args.parallelism} subtasks)", fl, size / fl / 1e6 / args.parallelism)]
    print(f"\nFlink savepoint {size / 1e6:.1f} MB ({windows} windows, {windows} timers); medians of {args.runs} "
          f"runs; load {os.getloadavg()} (a shared 2-core machine)")
    print(f"{'':38} {'seconds':>8} {'MB/s per core':>14} {'vs Flink':>9} {'target':>7}")
    flink_rate = rows[2][2]
    for label, seconds, rate in rows:
        print(f"{label:38} {seconds:8.2f} {rate:14.1f} {rate / flink_rate:8.2f}x {'50':>7}")


if __name__ == "__main__":
    main()
