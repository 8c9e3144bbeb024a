"""Flink export at scale: ``export_savepoint`` of a keygroups savepoint of ``--keys`` keys (1M by default), the
compiled path (``_native/flinkout.pyx``) beside the Python path (``exporter._entries`` per decoded key, what the
export ran before) doing the same work in the same run, and the ratio.

    python benchmarks/bench_flink_export.py [--keys 1000000] [--runs 3] [--python-runs 1]

The savepoint (cached in the temp directory) is written by ``keygroups.runtime.state_writer`` at parallelism 2, max
parallelism 128: per key a Long value, a String value, a TTL Long value, a List<Long> of 0-4 elements, a
Map<String, Long> of 0-3 entries and a record (exported as a Row). Throughput is the exported savepoint's bytes per
second (one core: the export is single-threaded); the memory figure is the peak the compiled export allocates
(tracemalloc, in a run of its own): it holds one key group at a time, so it grows with a key group, not the keys.
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
import tracemalloc

import numpy as np
import pyarrow as pa

import keygroups.flink.exporter as exporter
from keygroups._ranges import key_group_range
from keygroups.flink import export_savepoint
from keygroups.runtime.state_types import arrow_type
from keygroups.runtime.state_writer import (
    StateColumn,
    _key_groups,
    commit_savepoint,
    plan_savepoint,
    write_savepoint_subtask,
)
from keygroups.serializers import RecordSerializer
from keygroups.state import StateTtlConfig

RECORD = RecordSerializer("id bigint not null, name string, score double, ok boolean")
CHUNK = 200_000


def _columns(start: int, n: int) -> dict[str, pa.Array]:
    i = np.arange(start, start + n, dtype=np.int64)
    lists = [list(range(k % 5)) for k in range(start, start + n)]
    maps = [[(f"m{j}", k * j) for j in range(k % 4)] for k in range(start, start + n)]
    return {
        "k": pa.array(i),
        "long": pa.array(i * 7),
        "text": pa.array([f"value-{k}" for k in range(start, start + n)]),
        "list": pa.array(lists, pa.list_(pa.int64())),
        "map": pa.array(maps, pa.map_(pa.string(), pa.int64())),
        "rec": pa.array([{"id": k, "name": None if k % 3 == 0 else f"n{k}", "score": k / 3, "ok": k % 2 == 0}
                         for k in range(start, start + n)], arrow_type(RECORD.snapshot())),
    }


def write_keygroups_savepoint(location: str, keys: int, parallelism: int = 2, max_parallelism: int = 128) -> None:
    states = {"long": "long", "text": "text", "ttl": StateColumn("long", ttl=StateTtlConfig(ttl_ms=86_400_000)),
              "list": "list", "map": "map", "record": StateColumn("rec", serializer=RECORD)}
    batches = [pa.record_batch(_columns(s, min(CHUNK, keys - s))) for s in range(0, keys, CHUNK)]
    plan = plan_savepoint(batches[0].schema, location, "sp", key_columns="k", states=states,
                          max_parallelism=max_parallelism, parallelism=parallelism)
    handles = []
    for subtask in range(parallelism):
        mine = key_group_range(max_parallelism, parallelism, subtask)
        parts = []
        for b in batches:
            kgs = _key_groups(pa.Table.from_batches([b]), plan)
            parts.append(b.filter(pa.array((kgs >= mine.start) & (kgs <= mine.end))))
        handles.append(write_savepoint_subtask(plan, subtask, parts))
    commit_savepoint(plan, handles)


def _size(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--python-runs", type=int, default=1, help="runs of the (slow) Python path")
    args = ap.parse_args()

    cache = pathlib.Path(tempfile.gettempdir()) / f"keygroups-bench-flink-export-{args.keys}"
    location = str(cache / "loc")
    if not (cache / "loc" / "savepoints" / "sp" / "_metadata").exists():
        shutil.rmtree(cache, ignore_errors=True)
        t = time.perf_counter()
        write_keygroups_savepoint(location, args.keys)
        print(f"wrote the keygroups savepoint in {time.perf_counter() - t:.1f} s")
    print(f"keygroups savepoint: {_size(cache / 'loc') / 1e6:.1f} MB, {args.keys} keys x 6 states, parallelism 2, "
          f"max parallelism 128; load {os.getloadavg()}")

    def run(compiled: bool) -> tuple[float, int]:
        work = pathlib.Path(tempfile.mkdtemp(prefix="keygroups-bench-flink-export-"))
        exporter._COMPILED = compiled
        try:
            t = time.perf_counter()
            export_savepoint(location, work / "flink", uid="op", savepoint="sp")
            seconds = time.perf_counter() - t
            return seconds, _size(work / "flink")
        finally:
            exporter._COMPILED = True
            shutil.rmtree(work, ignore_errors=True)

    compiled, python = [], []
    size = 0
    for i in range(max(args.runs, args.python_runs)):
        if i < args.runs:
            seconds, size = run(True)
            compiled.append(seconds)
            print(f"compiled run {i + 1}: {seconds:.2f} s, {size / seconds / 1e6:.1f} MB/s; load {os.getloadavg()}")
        if i < args.python_runs:
            seconds, _ = run(False)
            python.append(seconds)
            print(f"python run {i + 1}: {seconds:.2f} s, {size / seconds / 1e6:.1f} MB/s; load {os.getloadavg()}")

    c, p = statistics.median(compiled), statistics.median(python)
    print(f"\nexported {size / 1e6:.1f} MB; medians ({len(compiled)} compiled, {len(python)} Python runs); "
          f"load {os.getloadavg()} (a shared 2-core machine)")
    print(f"{'':28} {'seconds':>8} {'MB/s (1 core)':>14} {'target':>7}")
    print(f"{'compiled export':28} {c:8.2f} {size / c / 1e6:14.1f} {'50':>7}")
    print(f"{'Python export (baseline)':28} {p:8.2f} {size / p / 1e6:14.1f}")
    print(f"compiled / Python: {p / c:.1f}x faster")
    tracemalloc.start()   # a run of its own: tracing slows the Python heap down
    run(True)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(f"peak memory allocated during one compiled export (tracemalloc: bytes read, blocks, buffers): "
          f"{peak / 1e6:.1f} MB for {size / 1e6:.1f} MB exported")


if __name__ == "__main__":
    sys.exit(main())
