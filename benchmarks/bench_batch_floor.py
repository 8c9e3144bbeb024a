"""A 10k-event micro-batch through ``KeyedJob`` beside Spark's own floor for the same batch (issue 32, "How we will
know" 1: ≤ 1.2× the floor).

    python benchmarks/bench_batch_floor.py               # the issue's size: 100k keys, 10k-event batches, medians of 5
    python benchmarks/bench_batch_floor.py --quick       # 20k keys, 2k-event batches, medians of 3 (a minute)
    python benchmarks/bench_batch_floor.py --backend rocksdb --runs 7

One Spark session (``local[2]``). The job is :class:`_jobs.RunningValue` (one ValueState per key, read and updated
once per record, one output row per record) at parallelism 2, max parallelism 128, heap state loaded with every key
(one untimed batch of ``--keys`` records). Then, round by round (the order alternating), the same event file
(``--batch`` events over the same keys, from ``_events.py``) goes through both candidates:

- keygroups: ``job.run_batch(spark.read.parquet(file), parallelism=2)`` and ``result.output.count()`` (the sink reads
  the output: ``BatchResult.output`` is what a sink gets);
- Spark's floor: ``spark.read.parquet(file).repartition(2, "key").mapInArrow(identity).count()``: read the file,
  shuffle by key, hand every record to a Python worker and back, count.

And, unless ``--no-sinks``, the output consumed inside the keyed stage by an in-task sink (:mod:`keygroups.sinks`,
committed with the checkpoint; no output files in the checkpoint, no second Spark action), each beside the floor
doing the same work, in the same rounds:

- keygroups with a :class:`~keygroups.sinks.CountingSink` (each task counts its output rows and pre-commits the count;
  the driver's commit adds them up) beside the floor's ``count()`` above;
- keygroups with a :class:`~keygroups.sinks.ParquetSink` (each task stages its output as a Parquet file, the driver's
  commit publishes it by rename) beside the floor writing the same rows with Spark's writer
  (``...mapInArrow(identity).write.mode("append").parquet(dir)``, zstd as the sink's).

Each candidate's time is wall clock on the driver around that one call (output count included). Beside it, per
candidate: the time its Spark jobs ran (the union of their submission-to-completion intervals, from Spark's status
store) and the rest ("outside jobs": the driver's own work: Catalyst, py4j, and for keygroups its driver code, the
storage listing and the commit); the CPU seconds of the driver's Python, the JVM and Spark's Python workers (from
/proc); and for keygroups the batch's ``BatchReport`` phases (plan and commit on the driver; restore, process and
snapshot of the slowest subtask, inside the Spark job); the outside-jobs time split by what the driver's main thread
waited for (``bench_driver_overhead.SplitClock``: Spark's JVM through py4j, or its own Python), and how much of
keygroups' wall the sink's read of the committed output took (an action of its own). Medians over ``--runs`` rounds
after ``--warmup`` untimed
ones. Every keygroups batch's output count is checked against the batch's record count, and the last batch's state
against pandas, before any figure is printed.

The machine may be shared: the load average is printed with the figures, and CPU seconds beside wall seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _events import event_files, generate_events  # noqa: E402
from _jobs import VALUE_OUTPUT, RunningValue, ship_by_value  # noqa: E402
from _peers import SparkTime, load, spark_session  # noqa: E402
from bench_driver_overhead import DriverSplit, SplitClock  # noqa: E402

PARALLELISM = 2
MAX_PARALLELISM = 128
TARGET = 1.2
PHASES = ("plan", "restore", "process", "snapshot", "commit")


def floor_batch(spark, path: str) -> int:  # noqa: ANN001
    """Spark's floor for one batch: read, shuffle by key, a Python mapInArrow returning the rows, count."""
    schema = "key long, value long, ts long"

    def identity(batches):  # noqa: ANN001, ANN202
        yield from batches

    return spark.read.parquet(path).repartition(PARALLELISM, "key").mapInArrow(identity, schema).count()


def keygroups_batch(job, spark, path: str):  # noqa: ANN001, ANN201
    """The batch and its sink's read of the output: ``(result, output count, seconds of the sink's read)``."""
    result = job.run_batch(spark.read.parquet(path), parallelism=PARALLELISM)
    t = time.perf_counter()
    counted = result.output.count()
    return result, counted, time.perf_counter() - t


def floor_parquet_batch(spark, path: str, out: str) -> None:  # noqa: ANN001
    """Spark's floor, writing the rows as Parquet with Spark's own writer instead of counting them."""
    schema = "key long, value long, ts long"

    def identity(batches):  # noqa: ANN001, ANN202
        yield from batches

    (spark.read.parquet(path).repartition(PARALLELISM, "key").mapInArrow(identity, schema)
     .write.mode("append").option("compression", "zstd").parquet(out))


def load_state(job, spark, keys: int) -> None:  # noqa: ANN001
    from pyspark.sql import functions as F

    df = spark.range(0, keys, numPartitions=PARALLELISM).select(F.col("id").alias("key"), F.lit(0).cast("long")
                                                                .alias("value"), F.lit(0).cast("long").alias("ts"))
    result = job.run_batch(df, parallelism=PARALLELISM)
    print(f"  loaded {keys:,} keys in {result.seconds:.1f} s: {result.report}", flush=True)


def check_state(job, spark, files: list[str]) -> None:  # noqa: ANN001
    """The last batch's output: each key's sum is the sum of its values over every batch run so far."""
    last = job.latest_checkpoint()
    out = spark.read.parquet(*[f"{job.storage.location.rstrip('/')}/{f}" for f in last.outputs]).toPandas()
    events = pq.read_table(files, columns=["key", "value"]).to_pandas()
    expected = events.groupby("key")["value"].sum()
    final = out.groupby("key")["sum"].max()   # values are >= 0: a key's last running sum is its largest
    wrong = int((expected.reindex(final.index).to_numpy() != final.to_numpy()).sum())
    if wrong:
        raise SystemExit(f"keygroups: {wrong} of {len(final)} keys have a wrong running sum in the last batch")


def report_seconds(report) -> dict[str, float]:  # noqa: ANN001
    """Every time the batch's report gives, by name: the fields of ``report.seconds`` (whatever they are as the report
    grows, e.g. Spark's own job time, issue 32 item 5), NaN for a known phase it lacks."""
    seconds = report.seconds
    names = [f.name for f in dataclasses.fields(seconds)] if dataclasses.is_dataclass(seconds) else list(PHASES)
    out = {p: float("nan") for p in PHASES}
    out.update({n: float(getattr(seconds, n)) for n in names if isinstance(getattr(seconds, n, None), (int, float))})
    return out


def row(label: str, splits: list[DriverSplit]) -> dict[str, float]:
    times: list[SparkTime] = [s.timed for s in splits]
    return {"label": label, "wall": statistics.median(t.wall for t in times),
            "own_python": statistics.median(s.python for s in splits),
            "waits_jvm": statistics.median(s.jvm for s in splits),
            "jobs": statistics.median(t.spark_jobs for t in times),
            "outside": statistics.median(t.outside_jobs for t in times),
            "n_jobs": statistics.median(t.jobs for t in times),
            **{k: statistics.median(t.cpu[k] for t in times) for k in ("driver", "jvm", "python workers")}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20k keys, 2k-event batches, 3 runs")
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=10_000, help="events per micro-batch")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--backend", choices=["heap", "rocksdb"], default="heap")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--no-sinks", action="store_true", help="leave out the in-task sinks and their floors")
    args = parser.parse_args(argv)
    if args.quick:
        args.keys, args.batch, args.runs, args.warmup = 20_000, 2_000, 3, 1

    work = pathlib.Path(tempfile.mkdtemp(prefix="kg-bench-floor-"))
    rounds = args.warmup + args.runs
    files = generate_events(work / "events", rounds * args.batch, args.keys, rounds)
    files = event_files(work / "events")
    ship_by_value()
    spark = spark_session(args.master, "keygroups-bench-batch-floor", shuffle_partitions=PARALLELISM)
    clock = SplitClock(spark)
    from keygroups.spark import KeyedJob

    job = KeyedJob("batch-floor", "key", RunningValue(), output_schema=VALUE_OUTPUT, max_parallelism=MAX_PARALLELISM,
                   checkpoint_location=str(work / "checkpoints"), backend=args.backend)
    from keygroups.sinks import CountingSink, ParquetSink

    counting = CountingSink()
    sink_jobs = {} if args.no_sinks else {
        "count": KeyedJob("batch-floor-count", "key", RunningValue(), output_schema=VALUE_OUTPUT,
                          max_parallelism=MAX_PARALLELISM, checkpoint_location=str(work / "checkpoints-count"),
                          backend=args.backend, sink=counting),
        "parquet": KeyedJob("batch-floor-parquet", "key", RunningValue(), output_schema=VALUE_OUTPUT,
                            max_parallelism=MAX_PARALLELISM, checkpoint_location=str(work / "checkpoints-parquet"),
                            backend=args.backend, sink=ParquetSink(str(work / "sink-out")))}
    floor_out = str(work / "floor-out")
    sink_splits: dict[str, list[DriverSplit]] = {"count": [], "parquet": [], "floor parquet": []}
    print(f"{args.keys:,} keys of {args.backend} state, {args.batch:,}-event batches, p={PARALLELISM}, "
          f"max p={MAX_PARALLELISM}, {args.master}; {args.warmup} warm-up + {args.runs} timed rounds; {load()}",
          flush=True)
    ours: list[DriverSplit] = []
    floor: list[DriverSplit] = []
    phases: list[dict[str, float]] = []
    sink_reads: list[float] = []
    try:
        load_state(job, spark, args.keys)
        for sink_job in sink_jobs.values():
            load_state(sink_job, spark, args.keys)
        for i, path in enumerate(files):
            warm = i < args.warmup

            def run_ours(path: str = path) -> SparkTime:
                (result, counted, read), split = clock.split(lambda: keygroups_batch(job, spark, path))
                t = split.timed
                if counted != args.batch or result.records_in != args.batch:
                    raise SystemExit(f"keygroups batch {i}: {result.records_in} records in, output count {counted}; "
                                     f"expected {args.batch} each")
                if not warm:
                    ours.append(split)
                    phases.append(report_seconds(result.report))
                    sink_reads.append(read)
                return t

            def run_floor(path: str = path) -> SparkTime:
                counted, split = clock.split(lambda: floor_batch(spark, path))
                if counted != args.batch:
                    raise SystemExit(f"floor batch {i}: counted {counted}, expected {args.batch}")
                if not warm:
                    floor.append(split)
                return split.timed

            def run_count(path: str = path) -> SparkTime:
                result, split = clock.split(lambda: sink_jobs["count"].run_batch(spark.read.parquet(path),
                                                                                 parallelism=PARALLELISM))
                if counting.committed.get(result.checkpoint_id) != args.batch:
                    raise SystemExit(f"counting sink, batch {i}: {counting.committed.get(result.checkpoint_id)} "
                                     f"rows committed, expected {args.batch}")
                if not warm:
                    sink_splits["count"].append(split)
                return split.timed

            def run_parquet(path: str = path) -> SparkTime:
                result, split = clock.split(lambda: sink_jobs["parquet"].run_batch(spark.read.parquet(path),
                                                                                   parallelism=PARALLELISM))
                if result.report.records_out != args.batch:
                    raise SystemExit(f"parquet sink, batch {i}: {result.report.records_out} rows out")
                if not warm:
                    sink_splits["parquet"].append(split)
                return split.timed

            def run_floor_parquet(path: str = path) -> SparkTime:
                _, split = clock.split(lambda: floor_parquet_batch(spark, path, floor_out))
                if not warm:
                    sink_splits["floor parquet"].append(split)
                return split.timed

            order = (run_ours, run_floor) if i % 2 == 0 else (run_floor, run_ours)
            if sink_jobs:
                order = (*order, *((run_count, run_parquet, run_floor_parquet) if i % 2 == 0
                                   else (run_floor_parquet, run_parquet, run_count)))
            done = {fn.__name__: fn() for fn in order}
            a, b = done["run_ours"], done["run_floor"]
            print(f"  {'warm-up' if warm else 'round'} {i + 1}: keygroups {a.wall:.3f} s ({a.jobs} jobs "
                  f"{a.spark_jobs:.3f} s), floor {b.wall:.3f} s ({b.jobs} jobs {b.spark_jobs:.3f} s); {load()}",
                  flush=True)
        check_state(job, spark, files)
        if sink_jobs:   # every row each wrote, each once: the load batch's and every round's
            written = pq.read_table(str(work / "sink-out")).num_rows
            floor_written = pq.read_table(floor_out).num_rows
            if written != args.keys + rounds * args.batch or floor_written != rounds * args.batch:
                raise SystemExit(f"parquet: the sink's directory holds {written:,} rows (expected "
                                 f"{args.keys + rounds * args.batch:,}), Spark's {floor_written:,} (expected "
                                 f"{rounds * args.batch:,})")
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)

    k, f = row("keygroups KeyedJob.run_batch + output.count()", ours), row("Spark floor (read, shuffle, mapInArrow, "
                                                                          "count)", floor)
    print(f"\n== one {args.batch:,}-event batch on {args.keys:,} keys ({args.backend}), medians of {args.runs}; "
          f"{load()} (2 cores, shared machine)")
    print(f"{'candidate':<52}{'wall s':>8}{'Spark jobs s':>13}{'outside jobs s':>15}{'jobs':>6}"
          f"{'CPU driver':>11}{'CPU JVM':>9}{'CPU workers':>12}")
    for r in (k, f):
        print(f"{r['label']:<52}{r['wall']:>8.3f}{r['jobs']:>13.3f}{r['outside']:>15.3f}{r['n_jobs']:>6.0f}"
              f"{r['driver']:>11.3f}{r['jvm']:>9.3f}{r['python workers']:>12.3f}")
    ratio = k["wall"] / f["wall"]
    cpu_ratio = (k["driver"] + k["jvm"] + k["python workers"]) / (f["driver"] + f["jvm"] + f["python workers"])
    print(f"ratio keygroups / floor: wall {ratio:.2f}x (target <= {TARGET}x: {'meets' if ratio <= TARGET else 'misses'})"
          f", CPU of all processes {cpu_ratio:.2f}x")
    p = {name: statistics.median(ph[name] for ph in phases) for name in phases[0]}
    extra = [n for n in p if n not in PHASES]
    print(f"keygroups' BatchReport phases (medians): driver plan {p['plan']:.3f} s, commit {p['commit']:.3f} s; "
          f"slowest subtask restore {p['restore']:.3f}, process {p['process']:.3f}, snapshot {p['snapshot']:.3f} s")
    print(f"  keygroups' own share, by the clock: outside Spark's jobs {k['outside']:.3f} s (the floor's "
          f"{f['outside']:.3f}); inside its jobs the subtasks' restore + process + snapshot "
          f"{p['restore'] + p['process'] + p['snapshot']:.3f} s of {k['jobs']:.3f} s (the rest: Spark's scheduling, "
          "shuffle, Python workers, Arrow hand-over, output listing)")
    print(f"  outside Spark's jobs, by what the driver waited for: keygroups Python {k['own_python']:.3f} s, JVM "
          f"{k['waits_jvm']:.3f} s; the floor Python {f['own_python']:.3f} s, JVM {f['waits_jvm']:.3f} s "
          "(Python: keygroups' driver code, PySpark's wrappers, the commit's writes; JVM: py4j calls outside jobs, "
          "i.e. Catalyst, listing, submission)")
    print(f"  of keygroups' wall, the sink's read of the committed output (output.count(): a DataFrame over the "
          f"output files and one Spark job, an action the floor does not have) {statistics.median(sink_reads):.3f} s")
    if sink_jobs:
        c, cp, fp = (row(label, sink_splits[name]) for label, name in (
            ("keygroups run_batch, in-task CountingSink", "count"),
            ("keygroups run_batch, in-task ParquetSink", "parquet"),
            ("Spark floor writing Parquet (Spark's writer)", "floor parquet")))
        print(f"\n== the output consumed in the keyed stage by an in-task sink (two-phase commit with the checkpoint), "
              f"medians of {args.runs}, same rounds")
        print(f"{'candidate':<52}{'wall s':>8}{'Spark jobs s':>13}{'outside jobs s':>15}{'jobs':>6}"
              f"{'CPU driver':>11}{'CPU JVM':>9}{'CPU workers':>12}")
        for r in (c, f, cp, fp):
            print(f"{r['label']:<52}{r['wall']:>8.3f}{r['jobs']:>13.3f}{r['outside']:>15.3f}{r['n_jobs']:>6.0f}"
                  f"{r['driver']:>11.3f}{r['jvm']:>9.3f}{r['python workers']:>12.3f}")

        def cpu(r: dict[str, float]) -> float:
            return r["driver"] + r["jvm"] + r["python workers"]

        print(f"ratio counting sink / floor count: wall {c['wall'] / f['wall']:.2f}x (target <= {TARGET}x: "
              f"{'meets' if c['wall'] / f['wall'] <= TARGET else 'misses'}), CPU {cpu(c) / cpu(f):.2f}x")
        print(f"ratio Parquet sink / Spark's Parquet writer: wall {cp['wall'] / fp['wall']:.2f}x, "
              f"CPU {cpu(cp) / cpu(fp):.2f}x")
    if extra:
        print("  the report's other times: " + ", ".join(f"{n} {p[n]:.3f} s" for n in extra))
    else:
        print("  (BatchReport carries no Spark job time yet (issue 32 item 5): the job times above come from Spark's "
              "status store, read by the benchmark)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
