"""Skew-aware key-group ranges (issues 26 and 31): Flink's equal ranges beside balanced ranges, the same batches
through the same driver and subtasks, on Zipf, one hot key and a moving hot spot.

    python benchmarks/bench_skew.py [--state-keys 1000000] [--records 1000000] [--batches 12] [--runs 5]
                                    [--parallelism 8] [--streams zipf1.1 hotkey moving2] [--max-parallelism 128]
                                    [--functions per-record] [--backends heap]

Streams over ``--state-keys`` keys (int64): ``zipfS`` (key of rank r drawn with probability proportional to r^-s,
ranks shuffled over the key space), ``hotkey`` (one key carries 30% of the records, the rest uniform), ``movingN``
(4 hot keys carry 50% of the records and move to 4 other keys every N batches: the trust review's case, N = 2),
``tenants`` (8 fixed tenants carry 40%). Each job starts from a savepoint holding every key (written without a job, so
no record of it weighs in the load figures), then runs ``--batches`` batches of ``--records`` records through the
real driver and subtasks (``runtime.subtask.run_keyed_subtask`` per subtask, one after another, each timed: the
batch's critical path is its slowest subtask, as on a cluster with a core per subtask), warm heap backends kept in
this process as Spark's reused workers keep them. Side by side, the same records under ``FlinkRanges()`` and
``BalancedRanges()`` (defaults: Flink's ranges until the forecast has gained on 4 measured batches), with a function
called per record (``process_element``) or a vectorized one (``process_key_batch``: a hot key costs one call).

Printed per stream, Flink's ranges | balanced, each a median over ``--runs`` runs:

* work max/mean: the largest subtask's work (calls of the function, as the subtasks count them) over the mean, per
  batch, averaged over all batches and over the batches after the forecast's first 5 (balanced cannot use its
  forecast before); and records max/mean likewise;
* the batch's critical path (its slowest subtask, summed over the batches), in wall seconds and in the subtask's
  CPU seconds (``time.thread_time``: what a dedicated core would take, whatever the shared machine's load), and in
  CPU seconds over the batches after the first 5 (the first batch restores the whole state from the savepoint);
* bytes moved (state of the key groups that changed owner under the decision's best takeover) and bytes read by the
  subtasks' restores after the first batch (equal: each subtask resumes the warm state the decision's takeover gives
  it, shipped in ``KeyedTaskSpec.warm_takeover``);
* CPU seconds of the whole run (this process, ``time.process_time``) and the driver's decision time per batch.

The machine is shared: ``os.getloadavg()`` is printed beside the figures.
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from keygroups import assign_key_groups
from keygroups._ranges import operator_indexes_for_boundaries
from keygroups.checkpoint import CheckpointStorage
from keygroups.runtime import begin_batch, commit_batch
from keygroups.runtime.assignment import BalancedRanges, FlinkRanges, decode_counts, max_over_mean
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.runtime.state_writer import commit_savepoint, plan_savepoint, write_savepoint_subtask
from keygroups.runtime.subtask import run_keyed_subtask
from keygroups.runtime.subtask_state import HeapBackendRegistry
from keygroups.serializers import Int64Serializer
from keygroups.state import ValueStateDescriptor
from keygroups.state.timers import TimerQueueRegistry

SCHEMA = pa.schema([("key", pa.int64()), ("amount", pa.int64())])
OUTPUT = pa.schema([("key", pa.int64()), ("total", pa.int64())])
TOTAL = ValueStateDescriptor("total", Int64Serializer())
#: Batches before which a balanced assignment cannot use its forecast (no load, then 4 batches to measure it on).
WARMUP = 5


class Totals(KeyedProcessFunction):
    """Per key: the sum of its amounts (one ValueState), one call per key and batch (vectorized); no output."""

    def open(self, context):
        self.total = context.get_state(TOTAL)

    def process_key_batch(self, key, records, context):
        self.total.update((self.total.value() or 0) + records.num_rows)


class RecordTotals(KeyedProcessFunction):
    """The same sum, one call per record (``process_element``)."""

    def open(self, context):
        self.total = context.get_state(TOTAL)

    def process_element(self, record, context):
        self.total.update((self.total.value() or 0) + record["amount"])


FUNCTIONS = {"vectorized": Totals, "per-record": RecordTotals}


def stream_batches(stream: str, n: int, batches: int, keys: int, rng: np.random.Generator,
                   order: np.ndarray) -> list[np.ndarray]:
    """``batches`` arrays of ``n`` keys of ``stream`` (``order`` maps a rank to its key)."""
    if stream.startswith("zipf"):
        s = float(stream[4:])
        cdf = np.cumsum(np.arange(1, keys + 1, dtype=np.float64) ** -s)
        return [order[np.minimum(np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right"), keys - 1)]
                for _ in range(batches)]

    def spiked(hot: np.ndarray, share: float) -> np.ndarray:
        out = rng.integers(0, keys, n)
        spike = rng.random(n) < share
        out[spike] = hot[rng.integers(0, len(hot), int(spike.sum()))]
        return out

    if stream == "hotkey":
        return [spiked(order[:1], 0.3) for _ in range(batches)]
    if stream == "tenants":
        return [spiked(order[:8], 0.4) for _ in range(batches)]
    if stream.startswith("moving"):
        period, out = int(stream[6:]), []
        for b in range(batches):
            if b % period == 0:
                hot = rng.choice(keys, 4, replace=False)
            out.append(spiked(hot, 0.5))
        return out
    raise ValueError(f"unknown stream {stream!r}")


@dataclass
class Batch:
    decision: dict[str, Any]
    records: list[int]
    calls: list[float]
    seconds: list[float]
    cpu: list[float]
    bytes_read: int
    choose_seconds: float


@dataclass
class Run:
    batches: list[Batch]
    cpu_seconds: float
    wall_seconds: float


def write_state(location: str, keys: np.ndarray, mp: int) -> None:
    """Savepoint ``base`` in ``location``: every key with total 1 (the job's state before the measured batches)."""
    table = pa.table({"key": pa.array(keys, pa.int64()), "total": pa.array(np.ones(len(keys), dtype=np.int64))})
    plan = plan_savepoint(table.schema, location, "base", key_columns="key", states={"total": "total"},
                          max_parallelism=mp, parallelism=1)
    commit_savepoint(plan, [write_savepoint_subtask(plan, 0, table.to_batches())])


def run_job(location: str, assignment: Any, batches: list[pa.Table], mp: int, p: int, function_name: str,
            backend: str) -> Run:
    """Every batch through the driver and the subtasks (timed one by one), the first restoring savepoint ``base``."""
    storage = CheckpointStorage(location, retain=2)
    kept, kept_timers = HeapBackendRegistry(), TimerQueueRegistry()
    function = pickle.dumps(FUNCTIONS[function_name]())
    out = []
    cpu, wall = time.process_time(), time.perf_counter()
    for n, table in enumerate(batches):
        start = time.process_time()
        plan = begin_batch(storage, job_name="skew", max_parallelism=mp, parallelism=p, assignment=assignment,
                           savepoint="base" if n == 0 else None)
        choose = time.process_time() - start
        assert plan.assignment is not None and plan.boundaries is not None
        spec = plan.keyed_task(key_columns=("key",), function=function, input_schema=SCHEMA, output_schema=OUTPUT,
                               warm_heap_backends=p, backend=backend, local_dir=f"{location}-local")
        owners = operator_indexes_for_boundaries(plan.boundaries, assign_key_groups(table.column("key"), mp, "long"))
        order = np.argsort(owners, kind="stable")
        cuts = np.searchsorted(owners[order], np.arange(p + 1))
        reports, seconds, cpus = [], [], []
        for i in range(p):
            part = table.take(pa.array(order[cuts[i]:cuts[i + 1]]))
            began, began_cpu = time.perf_counter(), time.thread_time()
            reports.append(run_keyed_subtask(spec, i, part.to_batches(), warm=kept, warm_timers=kept_timers))
            seconds.append(time.perf_counter() - began)
            cpus.append(time.thread_time() - began_cpu)
        commit_batch(plan, reports)
        b = plan.boundaries
        calls = [float(decode_counts(r.key_group_calls, b[i + 1] - b[i], "calls").sum()) for i, r in enumerate(reports)]
        out.append(Batch(plan.assignment.to_json(), [r.records_in for r in reports], calls, seconds, cpus,
                         0 if n == 0 else sum(r.restored.bytes_read for r in reports), choose))
    return Run(out, time.process_time() - cpu, time.perf_counter() - wall)


def figures(run: Run) -> dict[str, float]:
    """One run's figures (see the module docs)."""
    b = run.batches
    return {
        "work": statistics.fmean(max_over_mean(x.calls) for x in b),
        "work settled": statistics.fmean(max_over_mean(x.calls) for x in b[WARMUP:]) if len(b) > WARMUP else
        float("nan"),
        "records": statistics.fmean(max_over_mean(x.records) for x in b),
        "critical s": sum(max(x.seconds) for x in b),
        "critical cpu s": sum(max(x.cpu) for x in b),
        "settled cpu s": sum(max(x.cpu) for x in b[WARMUP:]),
        "moved MB": sum(x.decision["moved_bytes"] for x in b[1:]) / 1e6,
        "read MB": sum(x.bytes_read for x in b) / 1e6,
        "cpu s": run.cpu_seconds,
        "wall s": run.wall_seconds,
        "decide ms": 1e3 * statistics.median(x.choose_seconds for x in b),
    }


def report(label: str, runs: dict[str, list[Run]]) -> list[str]:
    print(f"\n== {label} (load {os.getloadavg()})")
    first = runs["balanced"][0].batches
    for n, batch in enumerate(first):
        d = batch.decision
        flink = runs["flink"][0].batches[n]
        print(f"  balanced batch {n:>2}: work max/mean {max_over_mean(batch.calls):.3f} (Flink's ranges "
              f"{max_over_mean(flink.calls):.3f}); slowest subtask {max(batch.cpu):.3f} CPU s (Flink's ranges "
              f"{max(flink.cpu):.3f}); moved {d['moved_bytes']:,} B, read {batch.bytes_read:,} B; {d['reason'][:90]}")
    medians = {name: {k: statistics.median(figures(r)[k] for r in rs) for k in figures(rs[0])}
               for name, rs in runs.items()}
    rows = []
    for key in medians["flink"]:
        f, b = medians["flink"][key], medians["balanced"][key]
        ratio = f"{b / f:.3f}x" if f else "-"
        rows.append(f"  {key:<13} {f:>12.3f} | {b:<12.3f} {ratio}")
        print(rows[-1])
    return [f"{label:<28} " + " ".join(f"{medians['flink'][k]:.3f}|{medians['balanced'][k]:.3f}"
                                       for k in ("work", "work settled", "records", "critical s", "critical cpu s",
                                                 "settled cpu s", "moved MB", "read MB", "cpu s"))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-keys", type=int, default=1_000_000)
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--batches", type=int, default=12)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-parallelism", type=int, default=128)
    parser.add_argument("--parallelism", type=int, nargs="+", default=[8])
    parser.add_argument("--streams", nargs="+", default=["zipf1.1", "hotkey", "moving2"])
    parser.add_argument("--functions", nargs="+", default=["per-record"], choices=sorted(FUNCTIONS))
    parser.add_argument("--backends", nargs="+", default=["heap"], choices=["heap", "rocksdb"])
    args = parser.parse_args()
    mp = args.max_parallelism
    print(f"bench_skew: {args.state_keys:,} keys of state, {args.batches} batches of {args.records:,} records, "
          f"max parallelism {mp}, medians of {args.runs} runs (each its own key draws); Flink's ranges | balanced; "
          f"load {os.getloadavg()} on {os.cpu_count()} cores (shared)", flush=True)
    summary = []
    for stream in args.streams:
        for backend, function, p in [(b, f, p) for b in args.backends for f in args.functions
                                     for p in args.parallelism]:
            runs: dict[str, list[Run]] = {"flink": [], "balanced": []}
            for seed in range(args.runs):
                rng = np.random.default_rng(31 + seed)
                order = rng.permutation(args.state_keys).astype(np.int64)
                batches = [pa.table({"key": pa.array(keys, pa.int64()),
                                     "amount": pa.array(np.ones(len(keys), dtype=np.int64))})
                           for keys in stream_batches(stream, args.records, args.batches, args.state_keys, rng, order)]
                for name, assignment in (("flink", FlinkRanges()), ("balanced", BalancedRanges())):
                    directory = tempfile.mkdtemp(prefix="bench-skew-")
                    try:
                        write_state(f"{directory}/chk", order, mp)
                        runs[name].append(run_job(f"{directory}/chk", assignment, batches, mp, p, function, backend))
                    finally:
                        shutil.rmtree(directory, ignore_errors=True)
            summary += report(f"{stream} {function} p={p}" + (f" {backend}" if backend != "heap" else ""), runs)
    print(f"\n== summary, medians of {args.runs} runs, Flink's ranges|balanced (load {os.getloadavg()})")
    print(f"{'stream, function, p':<28} work max/mean | after {WARMUP} batches | records max/mean | critical path s "
          f"(wall | CPU | CPU after {WARMUP} batches) | moved MB | read MB | CPU s")
    for row in summary:
        print(row)


if __name__ == "__main__":
    sys.exit(main())
