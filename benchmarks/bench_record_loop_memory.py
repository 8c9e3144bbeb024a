"""Issue 33 item 1: the peak memory of one batch's per-record loop, compiled (keygroups._native.recordloop) against
the Python loop it replaced (rows as dicts of the columns' ``to_pylist``, outputs gathered in a list and converted by
``output_table``), side by side on the same batches of issue 33's peer job (two ValueStates, one output row per record).

    python benchmarks/bench_record_loop_memory.py                      # 1M events, 100k keys, 5 batches, p=2
    python benchmarks/bench_record_loop_memory.py --events 200000 --keys 20000
    python benchmarks/bench_record_loop_memory.py --no-trace --runs 3   # CPU only (no tracemalloc), medians of 3

Per loop: the largest Python-heap peak of a batch (tracemalloc, reset before each batch: every per-record Python object
and the compiled loop's output buffers are in it; Arrow's own pool is not, and the two loops' Arrow work is the same
but for the output's conversion), and CPU per record (``process_time``, one run each, interleaved; the CPU figure is
bench_record_path.py's to quote, this one is for the memory).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time
import tracemalloc
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _events import event_files, generate_events  # noqa: E402
from _jobs import COUNT_SUM_OUTPUT, RunningCountSum  # noqa: E402

import keygroups.runtime.subtask as subtask  # noqa: E402
from keygroups.runtime.functions import KeyedProcessFunction  # noqa: E402
from keygroups.runtime.subtask_input import key_runs, output_table  # noqa: E402
from keygroups.state.timers import NO_WATERMARK  # noqa: E402
from keygroups.testing import KeyedFunctionHarness  # noqa: E402


class _ListSink(list):
    """The outputs as the Python loop kept them: a list, converted once at the end."""

    def __init__(self, schema: pa.Schema) -> None:
        super().__init__()
        self.schema = schema

    def table(self) -> pa.Table:
        return output_table(self, self.schema)


def python_process(spec: Any, function: KeyedProcessFunction, backend: Any, context: Any, records: Any, own: Any,
                   outputs: list[Any]) -> np.ndarray:
    """The per-record path of the Python loop that the compiled one replaced (its per-record branch only)."""
    table, groups = records.table, records.groups
    runs = key_runs(table, spec.key_columns)
    calls_per_group = np.bincount(groups[runs[:-1]] - own.start, minlength=len(own)) + records.records_per_group
    starts = pa.array(runs[:-1])
    run_keys = [table.column(c).take(starts).to_pylist() for c in spec.key_columns]
    keys = run_keys[0] if len(run_keys) == 1 else list(zip(*run_keys))
    if keys:
        backend.prefetch(keys, groups[runs[:-1]])
    rows: list[dict[str, Any]] = []
    if table.num_rows:
        names = table.column_names
        columns = [table.column(i).to_pylist() for i in range(table.num_columns)]
        rows = [dict(zip(names, values)) for values in zip(*columns)]
    stamps = records.event_times.tolist() if spec.timestamp_column is not None else None
    process = function.process_element
    for i, key in enumerate(keys):
        lo, hi = int(runs[i]), int(runs[i + 1])
        backend.set_current_key(key)
        context.current_key, context.current_key_group = key, backend.current_key_group
        for j in range(lo, hi):
            if stamps is not None:
                stamp = stamps[j]
                context._timestamp = None if stamp == NO_WATERMARK else stamp
            result = process(rows[j], context)
            if result is not None:
                outputs.extend(result)
    return calls_per_group


def run(loop: str, tables: list[pa.Table], trace: bool = True) -> tuple[int, float, int]:
    compiled = (subtask._process, subtask.OutputSink)
    if loop == "python":
        subtask._process, subtask.OutputSink = python_process, _ListSink   # type: ignore[assignment]
    peak_py = 0
    cpu = 0.0
    checksum = 0
    try:
        with KeyedFunctionHarness(RunningCountSum(), "key", output_schema=COUNT_SUM_OUTPUT, max_parallelism=128,
                                  parallelism=2, timestamp_column="ts") as h:
            for table in tables:
                if trace:
                    tracemalloc.start()
                    tracemalloc.reset_peak()
                c0 = time.process_time()
                h.process(table)
                cpu += time.process_time() - c0
                if trace:
                    peak_py = max(peak_py, tracemalloc.get_traced_memory()[1])
                    tracemalloc.stop()
                checksum += int(h.output_table().column("count").to_numpy().sum())
    finally:
        subtask._process, subtask.OutputSink = compiled   # type: ignore[assignment]
    return peak_py, cpu, checksum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--files", type=int, default=5)
    parser.add_argument("--trace", action=argparse.BooleanOptionalAction, default=True,
                        help="trace the Python heap (off: CPU per record only, without tracemalloc's overhead)")
    parser.add_argument("--runs", type=int, default=1, help="interleaved rounds; figures are medians")
    args = parser.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="kg-bench-loop-memory-"))
    generate_events(work / "events", args.events, args.keys, args.files)
    tables = [pq.read_table(f, columns=["key", "value", "ts"]) for f in event_files(work / "events")]
    per_batch = args.events // args.files
    print(f"{args.events:,} events, {args.keys:,} keys, {args.files} batches of {per_batch:,}, p=2, max p 128, "
          f"{args.runs} interleaved round(s), tracemalloc {'on' if args.trace else 'off'} (shared machine)")
    rounds: dict[str, list[tuple[int, float, int]]] = {"python": [], "compiled": []}
    for r in range(args.runs):
        for loop in (("python", "compiled") if r % 2 == 0 else ("compiled", "python")):
            rounds[loop].append(run(loop, tables, args.trace))
    results = {}
    for loop, runs in rounds.items():
        peak_py = int(statistics.median(x[0] for x in runs))
        cpu = statistics.median(x[1] for x in runs)
        results[loop] = (peak_py, cpu, runs[0][2])
        print(f"  {loop:9s} loop: peak Python heap per batch "
              f"{f'{peak_py / 2**20:8.1f} MiB' if args.trace else 'not traced'}, "
              f"{cpu / args.events * 1e6:5.2f} CPU µs/record")
    if any(x[2] != results["python"][2] for runs in rounds.values() for x in runs):
        raise SystemExit("the two loops' outputs differ")
    if args.trace:
        print(f"compiled / python: peak Python heap per batch {results['compiled'][0] / results['python'][0]:.2f}x")
    print(f"compiled / python: CPU per record {results['compiled'][1] / results['python'][1]:.2f}x")


if __name__ == "__main__":
    main()
