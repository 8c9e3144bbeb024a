"""Heap state's memory per key beside a plain dict of the same keys and values (issue 34: one int64 key, one int64
ValueState), Spark-free, each case in a fresh interpreter.

Per case, N keys (key = i * 7919 + 11, value = i * 3, both made per key as a job makes them) are written one by one,
then a checkpoint is taken, then one steady batch of 100k updates of random keys (read, add one, write) and its
checkpoint. Printed: the resident growth per key (``/proc/self/statm`` over the RSS before the load)
after the load, after the first checkpoint and after the batch's, and the CPU (``time.process_time``) and wall time
of the load, of the first checkpoint and of the batch; the dict's load and batch do the same work in plain Python.

* ``dict``: ``{key: value}``, the baseline (no checkpoint: it writes nothing);
* ``heap``: ``HeapKeyedStateBackend`` used for one batch (``compact_full_groups=False``: the decoded entries stay);
* ``heap kept``: a backend kept across batches, as the runtime keeps warm ones (``compact_full_groups=True``): a key
  group written full keeps its written bytes as its layer and drops the Python objects of the keys the last batch
  did not touch; a key a later batch reads is decoded from the layer again. Its checkpoints here are all full
  (``incremental=False``); with incremental ones a key group is folded so when it is next written full (after
  ``max_chain`` deltas, or once its deltas pass ``delta_fraction`` of it).

    python benchmarks/bench_heap_key_memory.py --keys 1000000 10000000 [--runs 3]

The machine may be shared: CPU time is printed beside wall time, with the load average; medians of ``--runs``.
"""

from __future__ import annotations

import argparse
import gc
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np

_PAGE = os.sysconf("SC_PAGE_SIZE")
BATCH = 100_000
MAXP = 128


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(t: tuple[float, float]) -> tuple[float, float]:
    return time.perf_counter() - t[0], time.process_time() - t[1]


def measure(case: str, n: int, work: str) -> dict[str, Any]:
    """One case in this (fresh) process: resident bytes per key and (wall, cpu) per phase."""
    rng = np.random.default_rng(7)
    batch = (rng.integers(0, n, BATCH, dtype=np.int64) * 7919 + 11).tolist()
    out: dict[str, Any] = {}
    gc.collect()
    base = rss()
    if case == "dict":
        d: dict[int, int] = {}
        t = _clock()
        for i in range(n):
            d[i * 7919 + 11] = i * 3
        out["load"] = _since(t)
        gc.collect()
        out["rss_load"] = (rss() - base) / n
        t = _clock()
        for k in batch:
            d[k] = d.get(k, 0) + 1
        out["batch"] = _since(t)
        out["rss_batch"] = (rss() - base) / n
        return out

    from keygroups import key_group_range
    from keygroups.checkpoint import CheckpointStorage
    from keygroups.serializers import Int64Serializer
    from keygroups.state import HeapKeyedStateBackend, ValueStateDescriptor

    storage = CheckpointStorage(os.path.join(work, f"{case.replace(' ', '-')}-{n}"))
    backend = HeapKeyedStateBackend(key_group_range(MAXP, 1, 0), MAXP, Int64Serializer(),
                                    compact_full_groups=case == "heap kept", incremental=case != "heap kept")
    state = backend.get_state(ValueStateDescriptor("v", Int64Serializer()))
    gc.collect()
    base = rss()
    set_key, update, value = backend.set_current_key, state.update, state.value
    t = _clock()
    for i in range(n):
        set_key(i * 7919 + 11)
        update(i * 3)
    out["load"] = _since(t)
    gc.collect()
    out["rss_load"] = (rss() - base) / n
    t = _clock()
    backend.snapshot(1, storage).result(600)
    backend.compact()
    gc.collect()
    out["checkpoint"] = _since(t)
    out["rss_checkpoint"] = (rss() - base) / n
    t = _clock()
    for k in batch:
        set_key(k)
        update((value() or 0) + 1)
    out["batch"] = _since(t)
    backend.snapshot(2, storage).result(600)
    backend.compact()
    gc.collect()
    out["rss_batch"] = (rss() - base) / n
    backend.dispose()
    return out


def _in_fresh_process(fn: Any, *args: Any) -> Any:
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def _phase(runs: list[dict[str, Any]], name: str) -> str:
    if name not in runs[0]:
        return f"{'-':>18s}"
    wall = statistics.median(r[name][0] for r in runs)
    cpu = statistics.median(r[name][1] for r in runs)
    return f"{cpu:7.2f}/{wall:7.2f} s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--cases", nargs="+", default=["dict", "heap", "heap kept"])
    args = parser.parse_args(argv)
    print(f"one int64 key, one int64 value per key; max parallelism {MAXP}, p=1; batch {BATCH:,} updates; "
          f"medians of {args.runs}; machine shared (load {os.getloadavg()[0]:.1f})")
    print(f"{'keys':>11s} {'case':<10s} {'B/key load':>10s} {'B/key chk':>10s} {'B/key batch':>11s}   "
          f"{'load cpu/wall':>18s} {'checkpoint cpu/wall':>20s} {'batch cpu/wall':>18s}")
    with tempfile.TemporaryDirectory() as work:
        for n in args.keys:
            per_case = {}
            for case in args.cases:
                runs = [_in_fresh_process(measure, case, n, work) for _ in range(args.runs)]
                per_case[case] = runs
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if k.startswith("rss")}
                chk = f"{med['rss_checkpoint']:10.1f}" if "rss_checkpoint" in med else f"{'-':>10s}"
                print(f"{n:>11,} {case:<10s} {med['rss_load']:10.1f} {chk} {med['rss_batch']:11.1f}   "
                      f"{_phase(runs, 'load'):>18s} {_phase(runs, 'checkpoint'):>20s} {_phase(runs, 'batch'):>18s}"
                      f"  [load {os.getloadavg()[0]:.1f}]", flush=True)
            if "dict" in per_case:
                base = statistics.median(r["rss_load"] for r in per_case["dict"])
                for case, runs in per_case.items():
                    if case != "dict":
                        final = statistics.median(r["rss_batch"] for r in runs)
                        print(f"{'':>11s} {case}: {final / base:.2f}x the dict's bytes per key after the batch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
