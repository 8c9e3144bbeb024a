"""Heap backend memory per key and the CPU of the batches that hold it (issue 34), Spark-free: a savepoint of N keys
with two int64 ValueStates (a running count and sum, as ``bench_rescale_scale.py``'s job), restored at p=2 by the
test harness (the job's own subtask code, both subtasks in this process, warm heap backends kept as a Spark worker
keeps them), then steady batches of 100k events.

Printed per phase: this process's resident growth per key (``/proc/self/statm``, over the RSS before the first
batch) and the CPU (``time.process_time``) and wall time of each batch:

* **first batch**: the cold restore of the savepoint (each subtask reads its key groups), 100k events, and the
  first checkpoint, written full (a savepoint's files are never shared with checkpoints);
* **restore alone**: a heap backend restored from the same savepoint for subtask 0 (lazily: bytes kept, nothing
  decoded), its CPU and its resident growth;
* **steady**: ``--steady`` warm batches of 100k events (keys drawn uniformly), the median printed.

The machine may be shared: CPU time is printed beside wall time, with the load average.

    python benchmarks/bench_heap_memory.py --keys 1000000 10000000 [--steady 3]
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
import pyarrow as pa

from keygroups import assign_key_groups, key_group_range
from keygroups.checkpoint import CheckpointStorage
from keygroups.runtime import KeyedProcessFunction
from keygroups.runtime.state_writer import commit_savepoint, plan_savepoint, write_savepoint_subtask
from keygroups.serializers import Int64Serializer
from keygroups.state import HeapKeyedStateBackend, ValueStateDescriptor
from keygroups.testing import KeyedFunctionHarness
from keygroups.testing.harness import HarnessSnapshot

MAXP = 128
P = 2
EVENTS = 100_000
_PAGE = os.sysconf("SC_PAGE_SIZE")


class RunningCountSum(KeyedProcessFunction):
    """Per key, the running count and sum of its events' ``v``, emitted with every event."""

    def open(self, context: Any) -> None:
        self.count = context.get_state(ValueStateDescriptor("count", Int64Serializer()))
        self.sum = context.get_state(ValueStateDescriptor("sum", Int64Serializer()))

    def process_element(self, record: Any, context: Any) -> Any:
        count = (self.count.value() or 0) + 1
        total = (self.sum.value() or 0) + record["v"]
        self.count.update(count)
        self.sum.update(total)
        return [(context.current_key, count, total)]


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def key_of(ids: np.ndarray) -> np.ndarray:
    return ids * 7919 + 11


def write_savepoint(location: str, n_keys: int) -> Any:
    """Savepoint "load": key k = id * 7919 + 11, count = id % 1000, sum = id * 3, for id < n_keys, in bulk."""
    ids = np.arange(n_keys, dtype=np.int64)
    keys = key_of(ids)
    table = pa.table({"k": keys, "count": ids % 1000, "sum": ids * 3})
    plan = plan_savepoint(table.schema, location, "load", key_columns="k", states={"count": "count", "sum": "sum"},
                          max_parallelism=MAXP, parallelism=P)
    groups = np.asarray(assign_key_groups(keys, MAXP))
    handles = []
    for i in range(P):
        r = key_group_range(MAXP, P, i)
        rows = np.flatnonzero((groups >= r.start) & (groups <= r.end))
        handles.append(write_savepoint_subtask(plan, i, table.take(pa.array(rows)).to_batches()))
    metadata = commit_savepoint(plan, handles)
    return metadata, sum(h.size for h in metadata.keyed_handles)


def events(n_keys: int, seed: int) -> pa.Table:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, n_keys, EVENTS, dtype=np.int64)
    return pa.table({"k": key_of(ids), "v": rng.integers(1, 100, EVENTS, dtype=np.int64)})


def timed(fn: Any) -> tuple[float, float, Any]:
    gc.collect()
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - w, time.process_time() - c, out


def restore_alone(location: str, metadata: Any, n_keys: int) -> str:
    gc.collect()
    before = rss()
    backend = HeapKeyedStateBackend(key_group_range(MAXP, P, 0), MAXP, Int64Serializer(), compact_full_groups=True)
    wall, cpu, stats = timed(lambda: backend.restore(CheckpointStorage(location), metadata))
    grown = rss() - before
    keys = n_keys * len(key_group_range(MAXP, P, 0)) / MAXP   # about this many keys are subtask 0's
    return (f"restore alone (subtask 0, {stats.bytes_read / 1e6:.0f} MB): wall {wall:6.2f} s  cpu {cpu:6.2f} s  "
            f"{grown / keys:6.1f} B resident per key")


def run(location: str, metadata: Any, n_keys: int, steady_batches: int, work: str) -> list[str]:
    lines = []
    schema = pa.schema([("k", pa.int64()), ("v", pa.int64())])
    harness = KeyedFunctionHarness(RunningCountSum(), "k", output_schema="k long, count long, sum long",
                                   input_schema=schema, max_parallelism=MAXP, parallelism=P, directory=work)
    snapshot = HarnessSnapshot(location, "load", metadata, 0, schema)
    restored = harness.restore(snapshot, parallelism=P)
    batches = [events(n_keys, seed) for seed in range(steady_batches + 1)]
    gc.collect()
    base = rss()
    wall, cpu, _ = timed(lambda: restored.process(batches[0]))
    restored.output()
    gc.collect()
    first_rss = rss() - base
    lines.append(f"first batch (cold restore, {EVENTS:,} events, full checkpoint): wall {wall:6.2f} s  cpu {cpu:6.2f} s  "
          f"{first_rss / n_keys:6.1f} B resident per key [load {os.getloadavg()[0]:.1f}]")
    steady = []
    for table in batches[1:]:
        steady.append(timed(lambda: restored.process(table))[:2])
        restored.output()
    gc.collect()
    after = rss() - base
    lines.append(f"steady batch (median of {len(steady)}): wall {statistics.median(s[0] for s in steady):6.3f} s  cpu "
          f"{statistics.median(s[1] for s in steady):6.3f} s  ({', '.join(f'{w:.3f}/{c:.3f}' for w, c in steady)})  "
          f"{after / n_keys:6.1f} B resident per key [load {os.getloadavg()[0]:.1f}]")
    restored.close()
    harness.close()
    return lines


def _in_fresh_process(fn: Any, *args: Any) -> Any:
    """``fn(*args)`` in a new interpreter (spawned), so that its resident memory starts from nothing of ours."""
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--steady", type=int, default=3)
    parser.add_argument("--work-dir", default=None, help="where the savepoint and checkpoints go (default: a "
                        "temporary directory; /dev/shm keeps file writes out of the figures)")
    args = parser.parse_args(argv)
    print(f"heap backend, two int64 ValueStates, max parallelism {MAXP}, p={P}, {EVENTS:,} events per batch; "
          f"machine shared (load {os.getloadavg()[0]:.1f})")
    with tempfile.TemporaryDirectory(dir=args.work_dir) as work:
        for n in args.keys:
            location = os.path.join(work, f"sp-{n}")
            wall, cpu, (metadata, size) = timed(lambda: _in_fresh_process(write_savepoint, location, n))
            print(f"\n{n:,} keys: savepoint written in {wall:.1f} s ({size / 1e6:.0f} MB) "
                  f"[load {os.getloadavg()[0]:.1f}]")
            print("  " + _in_fresh_process(restore_alone, location, metadata, n))
            for line in _in_fresh_process(run, location, metadata, n, args.steady, work):
                print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
