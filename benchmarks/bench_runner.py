"""The stateful runner against Spark's own state: per-key running count and sum over the same event log, same
machine, same run — keygroups' KeyedJob beside Spark's transformWithStateInPandas (ValueState, timeMode="None",
RocksDB state store) — then the cost of a rescale: restoring at p'=8 the checkpoint written at p=4; then the batch time with the input
read once (persisted while one Spark job counts it and finds its largest event time) beside the former path (a Spark
job per figure, each reading the input again), on JSON files, whose read costs something, with a watermark and a
parallelism policy, so that the batch needs both figures.

    python benchmarks/bench_runner.py                          # 5M events, 100k keys, 10 files, 3 runs
    python benchmarks/bench_runner.py --events 500000 --keys 20000 --runs 1
    python benchmarks/bench_runner.py --only-input-reads       # the read-once comparison alone

Both runners process one log file per micro-batch (one checkpoint each), at the same parallelism (Spark:
spark.sql.shuffle.partitions), and both results are checked against pandas before any figure is printed.
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

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _events import compare_state, event_files, generate_events, reference_state  # noqa: E402

from keygroups import key_group_range  # noqa: E402
from keygroups.checkpoint import CheckpointStorage  # noqa: E402
from keygroups.runtime import KeyedProcessFunction  # noqa: E402
from keygroups.runtime.backends import create_backend  # noqa: E402
from keygroups.serializers import Int64Serializer, TupleSerializer  # noqa: E402
from keygroups.state import ValueStateDescriptor  # noqa: E402

MAX_PARALLELISM = 128
OUTPUT = pa.schema([("key", pa.int64()), ("count", pa.int64()), ("sum", pa.int64())])
COUNT_SUM = ValueStateDescriptor("countSum", TupleSerializer(Int64Serializer(), Int64Serializer()))


class RunningCountSum(KeyedProcessFunction):
    """The same logic as the Spark baseline's StatefulProcessor, in keygroups' vectorized form."""

    def open(self, context):
        self.state = context.get_state(COUNT_SUM)

    def process_key_batch(self, key, records, context):
        count, total = self.state.value() or (0, 0)
        count += records.num_rows
        total += pc.sum(records.column("value")).as_py()
        self.state.update((count, total))
        return [(key, count, total)]


def run_keygroups(spark, files, location, parallelism):
    from keygroups.spark import KeyedJob

    job = KeyedJob("count-sum", "key", RunningCountSum(), output_schema=OUTPUT, max_parallelism=MAX_PARALLELISM,
                   checkpoint_location=location)
    start = time.perf_counter()
    events = 0
    for path in files:
        result = job.run_batch(spark.read.parquet(path), parallelism=parallelism)
        events += result.records_in
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "events": events, "events_per_s": events / seconds}


def json_event_files(files, directory) -> list[str]:
    """The event files as JSON lines, one file per micro-batch (reused when already there)."""
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for i, path in enumerate(files):
        target = directory / f"part-{i:05d}.json"
        if not target.exists():
            pd.read_parquet(path).to_json(target, orient="records", lines=True)
        out.append(str(target))
    return out


def run_input_reads(spark, files, location, parallelism, events_per_file, *, read_once):
    """Every file as one micro-batch of a job with a watermark and a RecordsPerSubtask policy (both need a figure
    of the whole batch before its records are placed); returns each batch's seconds."""
    from datetime import timedelta

    from keygroups.runtime import RecordsPerSubtask, WatermarkStrategy
    from keygroups.spark import KeyedJob

    job = KeyedJob("count-sum", "key", RunningCountSum(), output_schema=OUTPUT, max_parallelism=MAX_PARALLELISM,
                   checkpoint_location=location, timestamp_column="ts",
                   watermark_strategy=WatermarkStrategy.for_bounded_out_of_orderness(timedelta(seconds=5)))
    job._read_input_once = read_once
    policy = RecordsPerSubtask(max(1, events_per_file // parallelism))
    seconds = []
    for path in files:
        start = time.perf_counter()
        job.run_batch(spark.read.schema("key long, value long, ts long").json(path), parallelism=policy)
        seconds.append(time.perf_counter() - start)
    return seconds


def input_reads(spark, parquet_files, work, parallelism, runs, expected):
    """The read-once comparison: medians over ``runs`` of each path's median batch time, the paths alternating."""
    files = json_event_files(parquet_files, work / "events-json")
    events_per_file = max(1, sum(pq.ParquetFile(f).metadata.num_rows for f in parquet_files) // len(files))
    times = {False: [], True: []}
    for run in range(runs):
        for read_once in (False, True):
            location = str(work / f"reads-{run}-{read_once}")
            batches = run_input_reads(spark, files, location, parallelism, events_per_file, read_once=read_once)
            problems = compare_state(keygroups_state(location), expected)
            if problems:
                raise SystemExit(f"keygroups state differs from pandas (read_once={read_once}): {problems}")
            times[read_once].append(statistics.median(batches))
            print(f"run {run + 1}: {'read once' if read_once else 'former path'}: median batch "
                  f"{times[read_once][-1]:.2f} s over {len(batches)} batches", flush=True)
            shutil.rmtree(location, ignore_errors=True)
    before, after = statistics.median(times[False]), statistics.median(times[True])
    print(f"\n== input read once per batch: {len(files)} JSON files ({sum(os.path.getsize(f) for f in files) / 1e6:.0f}"
          f" MB), watermark + RecordsPerSubtask policy, medians of {runs} runs; load average {os.getloadavg()}")
    print(f"{'path':<58}{'batch seconds':>14}{'ratio':>9}")
    print(f"{'former: count, max event time, keyed stage (3 reads)':<58}{before:>14.2f}{before / after:>8.2f}x")
    print(f"{'read once: persisted, one job for count + max (1 read)':<58}{after:>14.2f}{1.0:>8.2f}x")


def keygroups_state(location) -> pd.DataFrame:
    storage = CheckpointStorage(location)
    backend = create_backend("heap", key_group_range(MAX_PARALLELISM, 1, 0), MAX_PARALLELISM, "long")
    backend.restore(storage, storage.latest())
    state = backend.get_state(COUNT_SUM)
    rows = []
    for key in backend.keys(COUNT_SUM.name):
        backend.set_current_key(key)
        rows.append((key, *state.value()))
    return pd.DataFrame(rows, columns=["key", "count", "sum"]).set_index("key").sort_index()


def rescale_cost(location, new_parallelism):
    """Restore every subtask of p' from the latest checkpoint, one after another in this process."""
    storage = CheckpointStorage(location)
    metadata = storage.latest()
    per_subtask = []
    for i in range(new_parallelism):
        rng = key_group_range(MAX_PARALLELISM, new_parallelism, i)
        for lazy in (True, False):
            backend = create_backend("heap", rng, MAX_PARALLELISM, "long")
            start = time.perf_counter()
            stats = backend.restore(storage, metadata, lazy=lazy)
            if lazy:
                first = next(iter(backend.keys(COUNT_SUM.name)), None)
                if first is not None:
                    backend.set_current_key(first)
                    backend.get_state(COUNT_SUM).value()
                lazy_s = time.perf_counter() - start
            else:
                eager_s = time.perf_counter() - start
        per_subtask.append((i, len(rng), stats.bytes_read, lazy_s, eager_s))
    total = sum(h.size for h in metadata.keyed_handles)
    return metadata.parallelism, total, per_subtask


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=5_000_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--files", type=int, default=10, help="log files = micro-batches")
    parser.add_argument("--parallelism", type=int, default=4)
    parser.add_argument("--rescale-to", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--skip-spark-baseline", action="store_true")
    parser.add_argument("--only-input-reads", action="store_true",
                        help="run only the comparison of one input read per batch with the former path")
    args = parser.parse_args(argv)

    work = pathlib.Path(tempfile.mkdtemp(prefix="kg-bench-runner-"))
    events_dir = work / "events"
    generate_events(events_dir, args.events, args.keys, args.files)
    files = event_files(events_dir)
    expected = reference_state(events_dir)

    from spark_tws_baseline import build_session, run_tws

    spark = build_session(args.master, driver_memory="4g")
    if args.only_input_reads:
        try:
            input_reads(spark, files, work, args.parallelism, args.runs, expected)
        finally:
            spark.stop()
            shutil.rmtree(work, ignore_errors=True)
        return
    ours, theirs = [], []
    kg_location = None
    try:
        for run in range(args.runs):
            kg_location = str(work / f"kg-{run}")
            r = run_keygroups(spark, files, kg_location, args.parallelism)
            problems = compare_state(keygroups_state(kg_location), expected)
            if problems:
                raise SystemExit(f"keygroups state differs from pandas: {problems}")
            ours.append(r["seconds"])
            print(f"run {run + 1}: keygroups {r['events']:,} events in {r['seconds']:.1f} s", flush=True)
            if not args.skip_spark_baseline:
                t = run_tws(spark, str(events_dir), str(work / f"tws-{run}"), args.parallelism)
                problems = compare_state(t["state"], expected)
                if problems:
                    raise SystemExit(f"transformWithStateInPandas state differs from pandas: {problems}")
                theirs.append(t["seconds"])
                print(f"run {run + 1}: transformWithStateInPandas {t['events']:,} events in {t['seconds']:.1f} s "
                      f"({t['batches']} batches)", flush=True)
                shutil.rmtree(work / f"tws-{run}", ignore_errors=True)
            if run + 1 < args.runs:
                shutil.rmtree(kg_location, ignore_errors=True)
        input_reads(spark, files, work, args.parallelism, args.runs, expected)
    finally:
        spark.stop()

    n = args.events
    print(f"\n== per-key running count and sum: {n:,} events, {args.keys:,} keys, {args.files} micro-batches, "
          f"parallelism {args.parallelism}, medians of {args.runs} runs")
    print(f"{'runner':<44}{'seconds':>10}{'events/s':>14}{'ratio':>9}")
    ours_s = statistics.median(ours)
    print(f"{'keygroups KeyedJob (heap state)':<44}{ours_s:>10.1f}{n / ours_s:>14,.0f}{1.0:>8.1f}x")
    if theirs:
        theirs_s = statistics.median(theirs)
        print(f"{'Spark transformWithStateInPandas (RocksDB)':<44}{theirs_s:>10.1f}{n / theirs_s:>14,.0f}"
              f"{theirs_s / ours_s:>8.1f}x slower")

    old_p, total, per_subtask = rescale_cost(kg_location, args.rescale_to)
    print(f"\n== rescale: restore at p'={args.rescale_to} of the checkpoint written at p={old_p} "
          f"({total / 1e6:.1f} MB of keyed state)")
    print(f"{'subtask':>8}{'key groups':>12}{'bytes read':>14}{'vs share':>10}{'lazy: first value':>20}{'eager':>10}")
    for i, groups, nbytes, lazy_s, eager_s in per_subtask:
        share = total * groups / MAX_PARALLELISM
        print(f"{i:>8}{groups:>12}{nbytes:>14,}{nbytes / share:>9.2f}x{lazy_s * 1e3:>17.1f} ms{eager_s * 1e3:>7.1f} ms")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
