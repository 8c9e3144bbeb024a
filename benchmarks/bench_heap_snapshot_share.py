"""The heap snapshot's share of a batch's CPU, with its sections encoded in C (``_native/heapsnap.pyx``) and, side
by side, with the per-entry Python encoding the heap used before (one Python call per key and per value, as
``HeapKeyedStateBackend._full_section_merged_in_python``; patched in for this comparison only).

The job is issue 33's (``_jobs.RunningCountSum``: two int64 ValueStates read and updated per record, one output row
per record) through ``KeyedFunctionHarness`` on the heap backend (p=2, max p 128), one ``process`` per event file
(one checkpoint each: the first full, the next incremental). Printed per mode: the CPU (``process_time``, every
thread of this process) and wall time of all batches, the CPU spent in the heap snapshots (``thread_time`` of the
synchronous capture plus the background writer: encoding, block framing and the file write), its share, and the
per-record CPU. Each mode runs in a fresh interpreter, rounds interleaved, medians of ``--runs``.

    python benchmarks/bench_heap_snapshot_share.py [--events 2000000 --keys 100000 --files 10 --runs 3]

The machine may be shared: CPU time is printed beside wall time, with the load average.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _events import event_files, generate_events  # noqa: E402
from _jobs import COUNT_SUM_OUTPUT, RunningCountSum  # noqa: E402


class _PerEntryPython:
    """``heapsnap``'s two functions as one Python call per key and value (the encoders themselves compiled)."""

    @staticmethod
    def _packed(items: list[bytes]) -> Any:
        if not items:
            return None
        return b"".join(items), [0, *itertools.accumulate(len(b) for b in items)]

    def delta_section(self, delta: dict, keys: Any, values: Any, missing: Any, deadline: Any = None) -> Any:
        put_keys, put_values, gone = [], [], []
        for k, v in delta.items():
            if v is missing:
                gone.append(keys.encode(k))
                continue
            put_keys.append(keys.encode(k))
            put_values.append(values.encode(v))
        return self._packed(put_keys), self._packed(put_values), self._packed(gone)


def run(mode: str, files: list[str]) -> dict[str, float]:
    import pyarrow.parquet as pq

    from keygroups.state import heap
    from keygroups.testing import KeyedFunctionHarness

    spent = [0.0]
    lock = threading.Lock()

    def timed(fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                with lock:
                    spent[0] += time.thread_time() - t
        return wrapper

    if mode == "per-entry Python":
        heap.heapsnap = _PerEntryPython()  # type: ignore[assignment]
        original_full = heap.HeapKeyedStateBackend._full_section

        def full_section(self: Any, c: Any, i: int) -> Any:
            m, layers = c.maps[i], c.layers[i]
            if m:
                return self._full_section_merged_in_python(c, m, layers or [])
            return original_full(self, c, i)

        heap.HeapKeyedStateBackend._full_section = full_section  # type: ignore[method-assign]
    heap.HeapKeyedStateBackend.snapshot = timed(heap.HeapKeyedStateBackend.snapshot)  # type: ignore[method-assign]
    heap.write_keyed_snapshot = timed(heap.write_keyed_snapshot)

    tables = [pq.read_table(f, columns=["key", "value", "ts"]) for f in files]
    records = 0
    with KeyedFunctionHarness(RunningCountSum(), "key", output_schema=COUNT_SUM_OUTPUT, max_parallelism=128,
                              parallelism=2, backend="heap") as h:
        c0, t0 = time.process_time(), time.perf_counter()
        for table in tables:
            h.process(table)
            records += h.output_table().num_rows
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"wall": wall, "cpu": cpu, "snapshot": spent[0], "records": records}


def _fresh(fn: Any, *args: Any) -> Any:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=2_000_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--files", type=int, default=10)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args(argv)
    modes = ["C sections", "per-entry Python"]
    with tempfile.TemporaryDirectory() as work:
        generate_events(os.path.join(work, "events"), args.events, args.keys, args.files)
        files = event_files(os.path.join(work, "events"))
        print(f"issue 33's job: {args.events:,} events, {args.keys:,} keys, {args.files} batches, heap, p=2; "
              f"medians of {args.runs}; machine shared (load {os.getloadavg()[0]:.1f})")
        results: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
        for r in range(args.runs):
            for mode in modes[r % 2:] + modes[:r % 2]:
                results[mode].append(_fresh(run, mode, files))
        for mode in modes:
            rs = results[mode]
            cpu = statistics.median(x["cpu"] for x in rs)
            wall = statistics.median(x["wall"] for x in rs)
            snap = statistics.median(x["snapshot"] for x in rs)
            share = statistics.median(x["snapshot"] / x["cpu"] for x in rs)
            n = rs[0]["records"]
            print(f"  {mode:<17s} batches cpu {cpu:6.2f} s  wall {wall:6.2f} s  snapshots cpu {snap:5.2f} s  "
                  f"= {share * 100:4.1f}% of the batches' CPU   {cpu / n * 1e6:.2f} µs CPU/record   "
                  f"[load {os.getloadavg()[0]:.1f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
