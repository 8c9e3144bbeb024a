"""Flink savepoints in and out: keygroups' import and export throughput beside Flink's own restore of the same
savepoint, in one run.

    python benchmarks/bench_flink_savepoint.py [--keys 100000] [--runs 3] [--parallelism 2]

A real Flink 2.3 job (tests/flink/SavepointJob.java, on Flink's MiniCluster; needs java 17 and the
apache-flink-libraries wheel) writes a canonical savepoint of ``--keys`` Long keys, each with the job's 21 keyed
states (every supported type, TTL, list and map state) and its timers (heap backend, no compression, every chunk in
a file). Then, medians of ``--runs`` interleaved runs:

* keygroups import: ``import_savepoint`` of the keyed operator (every state, Row included: the compiled path,
  ``keygroups._native.flinkin``) into a keygroups savepoint;
* keygroups export: ``export_savepoint`` of that keygroups savepoint back into a Flink savepoint;
* Flink restore: the net runtime of a Flink job that restores the savepoint (at the same parallelism) and ends,
  minus the net runtime of the same job restoring nothing (JVM and job start-up subtracted).

Throughput is the savepoint's bytes per second per core (keygroups runs on one core; Flink's restore runs
``--parallelism`` subtasks at once, so its figure is divided by that). The target is 50 MB/s per core both ways.
The import's process CPU time is printed too: on a loaded machine wall-clock time includes waiting for a core.
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

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from flink_harness import Fixture, restore_runtime_ms, write_savepoint  # noqa: E402

from keygroups.flink import export_savepoint, import_savepoint, read_savepoint  # noqa: E402


def _size(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--parallelism", type=int, default=2)
    args = ap.parse_args()

    cache = pathlib.Path(tempfile.gettempdir()) / f"keygroups-bench-flink-{args.keys}-p{args.parallelism}"
    if not (cache / "savepoint" / "_metadata").exists():
        shutil.rmtree(cache, ignore_errors=True)
        t = time.perf_counter()
        write_savepoint(cache, Fixture(args.parallelism, 128, False, args.keys, "long", "hashmap", False))
        print(f"Flink wrote the savepoint in {time.perf_counter() - t:.1f} s")
    savepoint = cache / "savepoint"
    size = _size(savepoint)
    sp = read_savepoint(savepoint)
    print(f"savepoint: {size / 1e6:.1f} MB, {args.keys} keys x 21 states + timers, parallelism {args.parallelism}, "
          f"max parallelism 128 (heap backend, uncompressed); load {os.getloadavg()}")

    imports, import_cpu, exports, flink = [], [], [], []
    exported_size = 0
    for run in range(args.runs):
        work = pathlib.Path(tempfile.mkdtemp(prefix="keygroups-bench-flink-"))
        try:
            t, cpu = time.perf_counter(), time.process_time()
            import_savepoint(sp, str(work / "loc"), "sp", uid="keyed")
            imports.append(time.perf_counter() - t)
            import_cpu.append(time.process_time() - cpu)
            t = time.perf_counter()
            export_savepoint(str(work / "loc"), work / "flink", uid="keyed", savepoint="sp", like=sp)
            exports.append(time.perf_counter() - t)
            exported_size = _size(work / "flink")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        base = restore_runtime_ms(None, args.parallelism, "long", "hashmap")
        full = restore_runtime_ms(savepoint, args.parallelism, "long", "hashmap")
        flink.append(max(full - base, 1) / 1000)
        print(f"run {run + 1}: import {imports[-1]:.2f} s, export {exports[-1]:.2f} s, Flink restore "
              f"{flink[-1]:.2f} s ({full} ms job with restore - {base} ms without); load {os.getloadavg()}")

    imp, exp, fl = (statistics.median(x) for x in (imports, exports, flink))
    rows = [("keygroups import (1 core)", imp, size / imp / 1e6),
            ("keygroups export (1 core)", exp, exported_size / exp / 1e6),
            (f"Flink restore ({args.parallelism} subtasks)", fl, size / fl / 1e6 / args.parallelism)]
    print(f"\nmedians of {args.runs} runs; load {os.getloadavg()} (a shared 2-core machine)")
    print(f"{'':34} {'seconds':>8} {'MB/s per core':>14} {'vs Flink':>9} {'target':>7}")
    flink_rate = rows[2][2]
    for label, seconds, rate in rows:
        print(f"{label:34} {seconds:8.2f} {rate:14.1f} {rate / flink_rate:8.2f}x {'50':>7}")
    cpu = statistics.median(import_cpu)
    print(f"keygroups import CPU time (median): {cpu:.2f} s, {size / cpu / 1e6:.1f} MB/s per core of CPU")


if __name__ == "__main__":
    main()
