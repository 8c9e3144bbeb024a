"""Skew-aware key-group ranges (issue 26): Flink's equal ranges beside balanced ranges on skewed key streams.

    python benchmarks/bench_skew.py [--state-keys 1000000] [--records 300000] [--batches 5] [--runs 3]
                                    [--parallelism 4 8] [--streams zipf1.1 zipf1.5 tenants] [--max-parallelism 128]
                                    [--functions per-record vectorized]

Streams over ``--state-keys`` keys (int64): Zipf with s = 1.1 and s = 1.5 (key of rank r drawn with probability
proportional to r^-s, ranks shuffled over the key space), and "few hot tenants" (8 tenants carry 40% of the records,
the rest uniform). Each job starts from a savepoint holding every key (the state: 1M keys, written without a job, so
no record of it weighs in the load figures), then runs ``--batches``
skewed batches of ``--records`` records through the real driver and subtasks (``runtime.subtask.run_keyed_subtask``
per subtask, one after another, each timed: the batch's critical path is its slowest subtask, as on a cluster with
a core per subtask), with warm heap backends kept in this process as Spark's reused workers keep them. Side by side,
the same records under ``assignment=FlinkRanges()`` and ``BalancedRanges()``, with a function called per record (``process_element``: its work follows records) and a
vectorized one (``process_key_batch``: a call per key, so a hot key costs one call):

* per subtask: records and calls of the function (it is vectorized: a call per key) of the last batch, state
  bytes of its range, and its time;
* max/mean of records, calls, state bytes and of the blended load the balanced ranges minimize (calls and state
  bytes, ``BalancedRanges().state_weight``), and the batch time
  (slowest subtask), Flink's beside balanced and their ratio;
* the boundary move (the first balanced batch): key groups moved, their state bytes, and the bytes the subtasks of
  the changed ranges read to restore, against the moved key groups' share (target <= 1.2x).

Target: max/mean <= 1.15 wherever no single key group exceeds the mean subtask load (the decision names the hot key
groups, and the max parallelism that would split them, where one does). Batch times are medians of ``--runs``; the
machine is shared, so ``os.getloadavg()`` is printed beside them.
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
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from keygroups import assign_key_groups
from keygroups._ranges import operator_indexes_for_boundaries
from keygroups.checkpoint import CheckpointStorage
from keygroups.runtime import begin_batch, commit_batch
from keygroups.runtime.assignment import (

    BalancedRanges,
    FlinkRanges,
    checkpoint_loads,
    decode_counts,
    max_over_mean,
    range_loads,
)
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


def draw(stream: str, n: int, keys: int, rng: np.random.Generator, order: np.ndarray) -> np.ndarray:
    """``n`` keys of ``stream`` (``order`` maps a rank to its key, shuffling ranks over the key space)."""
    if stream.startswith("zipf"):
        s = float(stream[4:])
        cdf = np.cumsum(np.arange(1, keys + 1, dtype=np.float64) ** -s)
        ranks = np.searchsorted(cdf, rng.random(n) * cdf[-1], side="right")
        return order[np.minimum(ranks, keys - 1)]
    if stream == "tenants":
        hot = rng.random(n) < 0.4
        out = rng.integers(0, keys, n)
        out[hot] = order[rng.integers(0, 8, int(hot.sum()))]
        return out
    raise ValueError(f"unknown stream {stream!r}")


@dataclass
class BatchFigures:
    decision: dict[str, Any]
    boundaries: tuple[int, ...]
    records: list[int]
    calls: list[int]
    state_bytes: list[int]
    seconds: list[float]
    restored: list[dict[str, Any]]
    blended: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def write_state(location: str, keys: np.ndarray, mp: int) -> None:
    """Savepoint ``base`` in ``location``: every key with total 1 (the job's state before the measured batches,
    written without a job, so no batch's records weigh in the load figures)."""
    table = pa.table({"key": pa.array(keys, pa.int64()), "total": pa.array(np.ones(len(keys), dtype=np.int64))})
    plan = plan_savepoint(table.schema, location, "base", key_columns="key", states={"total": "total"},
                          max_parallelism=mp, parallelism=1)
    commit_savepoint(plan, [write_savepoint_subtask(plan, 0, table.to_batches())])


def run_job(location: str, assignment: Any, batches: list[pa.Table], mp: int, p: int, function_name: str,
            backend: str = "heap") -> list[BatchFigures]:
    """Every batch through the driver and the subtasks (timed one by one), the first restoring savepoint ``base``;
    figures per batch."""
    storage = CheckpointStorage(location, retain=2)
    kept, kept_timers = HeapBackendRegistry(), TimerQueueRegistry()
    function = pickle.dumps(FUNCTIONS[function_name]())
    out = []
    for n, table in enumerate(batches):
        plan = begin_batch(storage, job_name="skew", max_parallelism=mp, parallelism=p, assignment=assignment,
                           savepoint="base" if n == 0 else None)
        spec = plan.keyed_task(key_columns=("key",), function=function, input_schema=SCHEMA, output_schema=OUTPUT,
                               warm_heap_backends=p, backend=backend, local_dir=f"{location}-local")
        owners = operator_indexes_for_boundaries(plan.boundaries, assign_key_groups(table.column("key"), mp, "long"))
        order = np.argsort(owners, kind="stable")
        cuts = np.searchsorted(owners[order], np.arange(p + 1))
        reports, seconds = [], []
        for i in range(p):
            part = table.take(pa.array(order[cuts[i]:cuts[i + 1]]))
            start = time.perf_counter()
            reports.append(run_keyed_subtask(spec, i, part.to_batches(), warm=kept, warm_timers=kept_timers))
            seconds.append(time.perf_counter() - start)
        metadata = commit_batch(plan, reports)
        state = range_loads(checkpoint_loads(metadata).state_bytes, plan.boundaries)
        assert plan.assignment is not None
        loads = checkpoint_loads(metadata)
        calls = range_loads(decode_calls(reports, plan.boundaries, mp), plan.boundaries)
        out.append(BatchFigures(plan.assignment.to_json(), plan.boundaries, [r.records_in for r in reports],
                                [int(x) for x in calls], [int(x) for x in state], seconds, [r.restored.to_json() for r in reports],
                                blended=max_over_mean(range_loads(loads.blend(BalancedRanges().state_weight),
                                                                  plan.boundaries))))
    return out


def decode_calls(reports: list[Any], boundaries: tuple[int, ...], mp: int) -> np.ndarray:
    """This batch's calls of the function per key group, from the subtasks' reports."""
    calls = np.zeros(mp)
    for r in reports:
        lo, hi = boundaries[r.subtask], boundaries[r.subtask + 1]
        calls[lo:hi] = decode_counts(r.key_group_calls, hi - lo, "calls")
    return calls


def ratio(values: list[float]) -> float:
    return max_over_mean(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--state-keys", type=int, default=1_000_000)
    parser.add_argument("--records", type=int, default=300_000)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-parallelism", type=int, default=128)
    parser.add_argument("--parallelism", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--streams", nargs="+", default=["zipf1.1", "zipf1.5", "tenants"])
    parser.add_argument("--functions", nargs="+", default=["per-record", "vectorized"], choices=sorted(FUNCTIONS))
    parser.add_argument("--backends", nargs="+", default=["heap"], choices=["heap", "rocksdb"])
    args = parser.parse_args()
    mp = args.max_parallelism
    print(f"bench_skew: {args.state_keys:,} keys of state, {args.batches} batches of {args.records:,} records, "
          f"max parallelism {mp}, medians of {args.runs} runs; load {os.getloadavg()}", flush=True)
    summary = []
    for stream in args.streams:
        rng = np.random.default_rng(26)
        order = rng.permutation(args.state_keys).astype(np.int64)
        skewed = [pa.table({"key": pa.array(draw(stream, args.records, args.state_keys, rng, order), pa.int64()),
                            "amount": pa.array(np.ones(args.records, dtype=np.int64))})
                  for _ in range(args.batches)]
        for backend, function, p in [(b, f, p) for b in args.backends for f in args.functions
                                     for p in args.parallelism]:
            runs: dict[str, list[list[BatchFigures]]] = {"flink": [], "balanced": []}
            for _ in range(args.runs):
                for name, assignment in (("flink", FlinkRanges()), ("balanced", BalancedRanges())):
                    directory = tempfile.mkdtemp(prefix="bench-skew-")
                    try:
                        write_state(f"{directory}/chk", order, mp)
                        runs[name].append(run_job(f"{directory}/chk", assignment, skewed, mp, p, function, backend))
                    finally:
                        shutil.rmtree(directory, ignore_errors=True)
            summary.append(report(f"{stream} {function}" + (f" {backend}" if backend != "heap" else ""), p, runs))
    print(f"\n== summary (load {os.getloadavg()})")
    print(f"{'stream, function':<21} {'p':>2} {'hot kg':>7} {'records max/mean':>17} {'calls max/mean':>17} "
          f"{'state max/mean':>17} {'blended max/mean':>17} "
          f"{'batch s (flink / balanced)':>28} {'move read/moved':>16}")
    for row in summary:
        print(row)


def move_figures(run: list[BatchFigures], p: int) -> float | None:
    """Print the first boundary move of a run of balanced batches (key groups moved, their state bytes, and what the
    subtasks of the changed ranges read: which key groups they kept warm, caught up and restored); the bytes read
    over the moved key groups' bytes, None without a move."""
    move = next(((i, b) for i, b in enumerate(run) if b.decision["reason"].startswith("boundaries moved")), None)
    if move is None:
        return None
    i, b = move
    changed = [j for j in range(p) if b.restored[j]["mode"] != "warm"]
    read = sum(b.restored[j]["bytes_read"] for j in changed)
    moved = b.decision["moved_bytes"]
    print(f"  move at batch {i}: {b.decision['moved_key_groups']} key groups moved holding {moved:,} B "
          f"({moved / max(b.decision['state_bytes'], 1):.1%} of the state); subtasks of changed ranges {changed} "
          f"read {read:,} B = {read / max(moved, 1):.2f}x the moved share (predicted restore of whole changed "
          f"ranges {b.decision['restore_bytes']:,} B)")
    for j in changed:
        r = b.restored[j]
        print(f"    subtask {j} ({r['mode']}): warm {r.get('warm_key_groups')} caught up "
              f"{r.get('caught_up_key_groups')} restored {r.get('restored_key_groups')} "
              f"({r.get('bytes_restored', r['bytes_read']):,} B) dropped {r.get('dropped_key_groups')}")
    return read / moved if moved else None


def report(stream: str, p: int, runs: dict[str, list[list[BatchFigures]]]) -> str:
    print(f"\n== {stream}, p={p} (load {os.getloadavg()})")
    last = {name: figures[0][-1] for name, figures in runs.items()}
    critical = {name: statistics.median(max(run[-1].seconds) for run in figures) for name, figures in runs.items()}
    for name, b in last.items():
        print(f"  {name:<9} ranges {list(b.boundaries)}")
        print(f"  {'':<9} records  {b.records}  max/mean {ratio(b.records):.3f}")
        print(f"  {'':<9} calls    {b.calls}  max/mean {ratio(b.calls):.3f}")
        print(f"  {'':<9} state B  {b.state_bytes}  max/mean {ratio(b.state_bytes):.3f}")
        print(f"  {'':<9} seconds  {[round(s, 3) for s in b.seconds]}  batch (slowest subtask, median) "
              f"{critical[name]:.3f}s")
        print(f"  {'':<9} blended load max/mean {b.blended:.3f}; decision: {b.decision['reason']}")
        if b.decision["hot_key_groups"]:
            print(f"  {'':<9} hot key groups: {b.decision['hot_key_groups']}")
    # the boundary move: the first batch whose balanced ranges changed
    for i, b in enumerate(runs["balanced"][0]):
        print(f"  balanced batch {i}: {b.decision['reason']}; blended load max/mean {b.blended:.3f}")
    move_note = "no move"
    ratios = [r for r in (move_figures(run, p) for run in runs["balanced"]) if r is not None]
    if ratios:
        move_note = f"{statistics.median(ratios):.2f}x"
        print(f"  move read / moved share, per run: {[round(r, 3) for r in ratios]}; median {move_note}")
    flink, balanced = last["flink"], last["balanced"]
    hot = "yes" if balanced.decision["hot_key_groups"] else "no"
    return (f"{stream:<21} {p:>2} {hot:>7} {ratio(flink.records):>7.3f} / {ratio(balanced.records):<7.3f} "
            f"{ratio(flink.calls):>7.3f} / {ratio(balanced.calls):<7.3f} "
            f"{ratio(flink.state_bytes):>7.3f} / {ratio(balanced.state_bytes):<7.3f} "
            f"{flink.blended:>7.3f} / {balanced.blended:<7.3f} {critical['flink']:>9.3f} / {critical['balanced']:<7.3f}"
            f" ({critical['flink'] / critical['balanced']:.2f}x) {move_note:>10}")


if __name__ == "__main__":
    sys.exit(main())
