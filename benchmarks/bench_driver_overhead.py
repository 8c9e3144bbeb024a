"""The driver's own work per micro-batch, everything but Spark's jobs (issue 32 target 2: ≤ 50 ms at max
parallelism 128, ≤ 150 ms at 4096 with 100 retained checkpoints).

    python benchmarks/bench_driver_overhead.py            # max p 128 and 4096, retain 100 (100 fill batches), 10 runs
    python benchmarks/bench_driver_overhead.py --quick    # retain 10 (10 fill batches), 3 runs
    python benchmarks/bench_driver_overhead.py --no-spark # only the Spark-free view (the harness)
    python benchmarks/bench_driver_overhead.py --quick --calls --max-parallelism 128  # and each py4j call of a batch

Two views of the same question, both through the public API only:

1. On Spark (``local[2]``): a ``KeyedJob`` (:class:`_jobs.RunningValue`, heap, p=2, ``retain=--retain``) loaded with
   ``--keys`` keys, then ``--retain`` untimed fill batches so that the location holds that many checkpoints, then
   ``--runs`` timed tiny batches (``--batch`` records, one Parquet file each: ``job.run_batch(df, parallelism=2)``
   over ``df = spark.read.parquet(f)`` built *before* the timed window). Each batch runs under a job group of its
   own; its Spark jobs' submission-to-completion
   intervals come from Spark's status store. Counted as the driver's own work: the batch's wall time on the driver
   minus the time in which at least one of its Spark jobs ran, i.e. keygroups' driver code (input checks, listing
   the storage and decoding ``_metadata``, planning, building and pickling the task spec, the commit, building the
   ``BatchResult``) plus what Spark's driver does for it outside jobs (Catalyst analysis and planning of the
   batch's DataFrames, py4j round trips). Beside it, the same figure for Spark's floor over the same file (read,
   shuffle by key, a Python ``mapInArrow``, count): the part of the driver's time any Spark batch pays; the
   difference is keygroups' own. Not counted: the keygroups code inside the tasks (restore, process, snapshot).

   Why the input is built outside the timed window: the input DataFrame is the user's. In a streaming query Spark's
   micro-batch builds it before ``foreachBatch`` calls ``run_batch``; in a batch job the user builds it. Building it
   here with ``spark.read.parquet`` lists the file and infers its schema (a Spark job of its own plus 100-270 ms
   outside jobs on a loaded machine), which is Spark's reader's work for the user, not the driver's work per batch
   that the target names. The floor gets the same treatment (its own DataFrame over the same file, built before
   its window). So that nothing is hidden, the time of building each input (``spark.read.parquet(f)``, outside
   its jobs) is measured too, and printed as a column "reader included": the input's build plus the batch's
   outside-jobs time, i.e. the figure earlier versions of this benchmark printed (they timed the read and the
   batch in one window).
2. Spark-free: ``KeyedFunctionHarness`` at the same max parallelism, p=2, ``--runs`` tiny batches after the same
   load; the driver's phases from ``HarnessBatch.phases``: ``plan`` (begin_batch: listing and reading the latest
   checkpoint, planning; placement) + ``commit`` (commit_batch) + ``output`` (reading the output files back),
   beside ``subtasks`` (the subtasks' own work, run in this process). The harness keeps one checkpoint
   (``retain=1`` is not a harness option), so this view has no retained-checkpoint history.

The Spark view also splits each call's outside-jobs time by what the driver's main thread was waiting for
(:class:`SplitClock`): Spark's JVM (every py4j call and result read outside a job: Catalyst's analysis and planning,
job submission) or nothing (the driver's own Python: keygroups' driver code, PySpark's
Python wrappers, the commit's file writes and fsyncs), for keygroups and the floor alike: "Python over floor" is
what keygroups' driver code costs a batch, "JVM over floor" what the extra planning of its DataFrames costs.

Medians over the timed batches; the wall clock is the driver's, on a machine that may be shared (load printed), CPU
seconds of the driver process beside it. Since a loaded machine inflates the wall time of every step (each py4j
call and each thread waits to be scheduled), a third table gives the CPU of each call's critical path: the JVM thread
that serves the driver's main Python thread (py4j pins one to it: it does Catalyst's work, the job's submission,
Spark's closure cleaner, the collect's hand-over, and waits without CPU while the jobs run) and the main Python thread
itself, for keygroups and the floor alike.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import re
import shutil
import statistics
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _events import event_files, generate_events  # noqa: E402
from _jobs import VALUE_OUTPUT, RunningValue, ship_by_value  # noqa: E402
from _peers import SparkJobClock, SparkTime, load, spark_session, spark_setting  # noqa: E402

from keygroups.spark.executor import _union  # noqa: E402  # the union of job spans, as the report's

PARALLELISM = 2
TARGETS = {128: 0.050, 4096: 0.150}


@dataclass(frozen=True)
class DriverSplit:
    """One timed call's time outside its Spark jobs, split by who the driver's main thread was waiting for:
    ``jvm`` while it waited on Spark's JVM outside any job (py4j calls: Catalyst's analysis and planning,
    job submission and result hand-over; reading a collect's rows), ``python``
    the rest (the driver's Python: keygroups' driver code and PySpark's Python wrappers, the commit's file writes
    and fsyncs)."""

    timed: SparkTime
    jvm: float
    py4j_calls: int
    #: CPU seconds over the call of the JVM thread that serves the driver's main Python thread (py4j's pinned
    #: thread: Catalyst, job submission, the closure cleaner, the collect's hand-over; it waits without CPU while
    #: the jobs run) and of the driver's main Python thread: what the call cost in CPU on its critical path, a
    #: figure that a loaded machine inflates far less than the wall time (NaN where the JVM does not say).
    jvm_cpu: float = float("nan")
    python_cpu: float = float("nan")
    #: Each wait on the JVM in call order: ``(what, where, seconds outside the call's Spark jobs)``: ``what`` the
    #: py4j command's target and method (or the collect's result read), ``where`` the Python line that issued it.
    calls: tuple[tuple[str, str, float], ...] = ()

    @property
    def python(self) -> float:
        return self.timed.outside_jobs - self.jvm


class SplitClock(SparkJobClock):
    """:class:`SparkJobClock`, and for each call the time the driver's main thread spent waiting on the JVM outside
    the call's Spark jobs (:class:`DriverSplit`): every py4j call and every read of a collect's result socket is
    timed (by wrapping py4j's ``send_command`` and PySpark's ``_load_from_socket``: a measurement, nothing
    changes what runs)."""

    def __init__(self, spark) -> None:  # noqa: ANN001
        super().__init__(spark)
        self._waits: list[tuple[float, float]] = []
        self._labels: list[tuple[str, str]] = []
        self._thread = threading.get_ident()
        self._jobs: list[tuple[float, float]] = []
        jvm = spark._jvm
        self._threads = jvm.java.lang.management.ManagementFactory.getThreadMXBean()
        self._jthread = jvm.java.lang.Thread.currentThread().getId()   # py4j pins this thread to ours
        self._wrap()

    def _jvm_cpu(self) -> float:
        nanos = self._threads.getThreadCpuTime(self._jthread)
        return nanos / 1e9 if nanos >= 0 else float("nan")

    def _record(self, start: float, command: str = "result read") -> None:
        if threading.get_ident() == self._thread:
            self._waits.append((start, time.time()))
            self._labels.append((_command_label(command), _origin()))

    def _wrap(self) -> None:
        from py4j import clientserver, java_gateway
        from pyspark.sql.classic import dataframe

        clock = self
        for cls in {clientserver.ClientServerConnection, java_gateway.GatewayConnection}:
            send = cls.send_command

            def timed_send(conn, command, *args, _send=send, **kwargs):  # noqa: ANN001, ANN202
                start = time.time()
                try:
                    return _send(conn, command, *args, **kwargs)
                finally:
                    clock._record(start, command)

            cls.send_command = timed_send
        load_from_socket = dataframe._load_from_socket

        @contextmanager
        def timed_load(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            start = time.time()
            try:
                with load_from_socket(*args, **kwargs) as stream:
                    yield stream
            finally:
                clock._record(start)

        dataframe._load_from_socket = timed_load
        # keygroups' own collect reads the served rows without PySpark's _load_from_socket (an earlier keygroups
        # has no such function: nothing to wrap then)
        from keygroups.spark import executor

        served = getattr(executor, "_served_rows", None)
        if served is not None:
            def timed_served(*args, _served=served, **kwargs):  # noqa: ANN002, ANN003, ANN202
                start = time.time()
                try:
                    return _served(*args, **kwargs)
                finally:
                    clock._record(start)

            executor._served_rows = timed_served

    def _intervals(self, group: str) -> list[tuple[float, float]]:
        self._jobs = super()._intervals(group)
        return self._jobs

    def split(self, fn):  # noqa: ANN001, ANN201
        """``(fn(), DriverSplit)``: only ``fn``'s own waits count (not the clock's calls around it)."""
        window: list[float] = []
        cpu: list[float] = []

        def inside():  # noqa: ANN202
            self._waits = []
            self._labels = []
            cpu.append(self._jvm_cpu())   # just outside the window: not counted as a wait on the JVM
            cpu.append(time.thread_time())
            window.append(time.time())
            try:
                return fn()
            finally:
                window.append(time.time())
                cpu.append(time.thread_time())
                cpu.append(self._jvm_cpu())

        result, timed = self.time(inside)
        jvm_cpu, python_cpu = cpu[3] - cpu[0], cpu[2] - cpu[1]
        start, end = window
        in_window = [(w, label) for w, label in zip(self._waits, self._labels) if w[0] >= start and w[1] <= end]
        waits = [(max(a, start), min(b, end)) for (a, b), _ in in_window]
        jobs = [(max(a, start), min(b, end)) for a, b in self._jobs]
        jvm = max(0.0, _union(jobs + waits) - _union(jobs))
        calls = tuple((what, where, max(0.0, _union(jobs + [w]) - _union(jobs)))
                      for w, (what, where) in zip(waits, (label for _, label in in_window)))
        return result, DriverSplit(timed, min(jvm, timed.outside_jobs), len(waits), jvm_cpu, python_cpu, calls)


def _command_label(command: str) -> str:
    """A py4j command as ``kind target.method`` (a call, a constructor, a reflection lookup, ...)."""
    lines = command.split("\n")
    kind = {"c": "call", "i": "new", "r": "reflect", "m": "memory", "a": "array", "l": "list", "f": "field"}.get(
        lines[0], lines[0])
    target = lines[1] if len(lines) > 1 else ""
    method = lines[2] if len(lines) > 2 and kind in ("call", "field") else ""
    if kind == "new":
        target = target.rsplit(".", 1)[-1]
    elif re.fullmatch(r"o[0-9]+", target):   # a JVM object's id: another each batch
        target = "obj"
    elif target.startswith("z:"):
        target = target[2:].rsplit(".", 1)[-1]
    return f"{kind} {target[:40]}{'.' + method[:40] if method else ''}"


def _origin() -> str:
    """The innermost keygroups line on the stack (else PySpark's): who issued a py4j call."""
    frame = sys._getframe(2)
    fallback = ""
    while frame is not None:
        name = frame.f_code.co_filename
        if "keygroups" in name and "bench_" not in name:
            return f"{pathlib.Path(name).name}:{frame.f_lineno} {frame.f_code.co_name}"
        if not fallback and "pyspark" in name:
            fallback = f"pyspark/{pathlib.Path(name).name}:{frame.f_lineno} {frame.f_code.co_name}"
        frame = frame.f_back
    return fallback


def print_calls(max_p: int, splits: list[DriverSplit]) -> None:
    """Each py4j call of the timed batches, in call order, with its median time outside the batch's Spark jobs
    (batches whose call sequence differs from the first's are left out of the medians)."""
    if not splits or not splits[0].calls:
        return
    shape = [(what, where) for what, where, _ in splits[0].calls]
    same = [s for s in splits if [(what, where) for what, where, _ in s.calls] == shape]
    print(f"\n   max p {max_p}: each wait on the JVM of a batch, in call order (median ms outside Spark's jobs over "
          f"{len(same)} of {len(splits)} batches with the same calls)")
    total = 0.0
    for i, (what, where) in enumerate(shape):
        ms = statistics.median(s.calls[i][2] for s in same) * 1e3
        total += ms
        print(f"{i + 1:>6}  {ms:7.2f}  {what:<58} {where}")
    print(f"{'':>6}  {total:7.2f}  (sum of the medians)")


def spark_view(spark, clock: SplitClock, max_p: int, args: argparse.Namespace, work: pathlib.Path,  # noqa: ANN001
               files: list[str]) -> dict[str, float]:
    from pyspark.sql import functions as F

    from keygroups.spark import KeyedJob

    job = KeyedJob(f"driver-{max_p}", "key", RunningValue(), output_schema=VALUE_OUTPUT, max_parallelism=max_p,
                   checkpoint_location=str(work / f"checkpoints-{max_p}"), retain=args.retain)
    keys = spark.range(0, args.keys, numPartitions=PARALLELISM).select(
        F.col("id").alias("key"), F.lit(1).cast("long").alias("value"), F.lit(0).cast("long").alias("ts"))
    t = time.perf_counter()
    job.run_batch(keys, parallelism=PARALLELISM)
    fill, timed = files[:args.retain], files[args.retain:]
    for f in fill:
        job.run_batch(spark.read.parquet(f), parallelism=PARALLELISM)
    print(f"  max p {max_p}: loaded {args.keys:,} keys and ran {len(fill)} fill batches in "
          f"{time.perf_counter() - t:.0f} s; {load()}", flush=True)

    def floor(df) -> int:  # noqa: ANN001
        def identity(batches):  # noqa: ANN001, ANN202
            yield from batches
        return df.repartition(PARALLELISM, "key").mapInArrow(
            identity, "key long, value long, ts long").count()

    ours: list[SparkTime] = []
    theirs: list[SparkTime] = []
    ours_split: list[DriverSplit] = []
    theirs_split: list[DriverSplit] = []
    plan, commit = [], []
    reads: list[SparkTime] = []
    floor_reads: list[SparkTime] = []
    for i, f in enumerate(timed):
        # the inputs are built outside the timed windows (see the module docs), each timed on its own
        df, read = clock.time(lambda f=f: spark.read.parquet(f))
        floor_df, floor_read = clock.time(lambda f=f: spark.read.parquet(f))
        reads.append(read)
        floor_reads.append(floor_read)
        result, s_ours = clock.split(lambda df=df: job.run_batch(df, parallelism=PARALLELISM))
        counted, s_floor = clock.split(lambda floor_df=floor_df: floor(floor_df))
        t_ours, t_floor = s_ours.timed, s_floor.timed
        ours_split.append(s_ours)
        theirs_split.append(s_floor)
        if result.records_in != args.batch or counted != args.batch:
            raise SystemExit(f"batch {i}: keygroups read {result.records_in}, the floor {counted}; expected "
                             f"{args.batch}")
        ours.append(t_ours)
        theirs.append(t_floor)
        plan.append(float(getattr(result.report.seconds, "plan", float("nan"))))
        commit.append(float(getattr(result.report.seconds, "commit", float("nan"))))
        print(f"    batch {i + 1}: keygroups {t_ours.wall * 1e3:.0f} ms, outside jobs {t_ours.outside_jobs * 1e3:.0f} "
              f"ms ({t_ours.jobs} jobs; reader included {(t_ours.outside_jobs + read.outside_jobs) * 1e3:.0f} ms); "
              f"floor {t_floor.wall * 1e3:.0f} ms, outside jobs "
              f"{t_floor.outside_jobs * 1e3:.0f} ms; outside jobs waiting on the JVM: keygroups "
              f"{s_ours.jvm * 1e3:.0f} ms ({s_ours.py4j_calls} calls), floor {s_floor.jvm * 1e3:.0f} ms "
              f"({s_floor.py4j_calls} calls); CPU (JVM thread + Python thread): keygroups "
              f"{s_ours.jvm_cpu * 1e3:.0f} + {s_ours.python_cpu * 1e3:.0f} ms, floor {s_floor.jvm_cpu * 1e3:.0f} + "
              f"{s_floor.python_cpu * 1e3:.0f} ms", flush=True)
    if args.calls:
        print_calls(max_p, ours_split)
    retained = sum(1 for p in pathlib.Path(job.storage.location).iterdir() if p.name.startswith("chk-"))
    med = statistics.median
    return {"wall": med(t.wall for t in ours), "outside": med(t.outside_jobs for t in ours),
            "jobs": med(t.spark_jobs for t in ours), "driver_cpu": med(t.cpu["driver"] for t in ours),
            "floor_wall": med(t.wall for t in theirs), "floor_outside": med(t.outside_jobs for t in theirs),
            "with_read": med(t.outside_jobs + r.outside_jobs for t, r in zip(ours, reads)),
            "floor_with_read": med(t.outside_jobs + r.outside_jobs for t, r in zip(theirs, floor_reads)),
            "plan": med(plan), "commit": med(commit), "retained": retained,
            "python": med(x.python for x in ours_split), "jvm": med(x.jvm for x in ours_split),
            "calls": med(x.py4j_calls for x in ours_split),
            "floor_python": med(x.python for x in theirs_split), "floor_jvm": med(x.jvm for x in theirs_split),
            "floor_calls": med(x.py4j_calls for x in theirs_split),
            "jvm_cpu": med(x.jvm_cpu for x in ours_split), "python_cpu": med(x.python_cpu for x in ours_split),
            "floor_jvm_cpu": med(x.jvm_cpu for x in theirs_split),
            "floor_python_cpu": med(x.python_cpu for x in theirs_split)}


def harness_view(max_p: int, args: argparse.Namespace, files: list[str]) -> dict[str, float]:
    from keygroups.testing import KeyedFunctionHarness

    with KeyedFunctionHarness(RunningValue(), "key", output_schema=VALUE_OUTPUT, max_parallelism=max_p,
                              parallelism=PARALLELISM) as h:
        h.process(pa.table({"key": pa.array(range(args.keys), pa.int64()),
                            "value": pa.array([1] * args.keys, pa.int64()),
                            "ts": pa.array([0] * args.keys, pa.int64())}))
        h.output_table()
        phases: dict[str, list[float]] = {}
        cpu = []
        for f in files[args.retain:]:
            table = pq.read_table(f)
            c = time.process_time()
            batch = h.process(table)
            cpu.append(time.process_time() - c)
            h.output_table()
            for k, v in batch.phases.items():
                phases.setdefault(k, []).append(v)
    out = {k: float("nan") for k in ("plan", "commit", "output", "subtasks")}   # in case a phase is renamed
    out.update({k: statistics.median(v) for k, v in phases.items()})
    out["cpu"] = statistics.median(cpu)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="retain 10, 3 runs, 20k keys")
    parser.add_argument("--max-parallelism", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--retain", type=int, default=100, help="retained checkpoints (= untimed fill batches)")
    parser.add_argument("--runs", type=int, default=10, help="timed batches")
    parser.add_argument("--keys", type=int, default=100_000, help="keys of state loaded first")
    parser.add_argument("--batch", type=int, default=10, help="records per tiny batch")
    parser.add_argument("--no-spark", action="store_true")
    parser.add_argument("--calls", action="store_true",
                        help="list each py4j call of a batch (call order, median ms outside jobs, who issued it)")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--spark-conf", action="append", default=[], metavar="KEY=VALUE", type=spark_setting,
                        help="a setting of the Spark session (repeatable), e.g. spark.sql.ui.explainMode=simple")
    args = parser.parse_args(argv)
    if args.quick:
        args.retain, args.runs, args.keys = 10, 3, 20_000

    work = pathlib.Path(tempfile.mkdtemp(prefix="kg-bench-driver-"))
    n_files = args.retain + args.runs
    generate_events(work / "events", n_files * args.batch, args.keys, n_files)
    files = event_files(work / "events")
    print(f"tiny batches of {args.batch} records, p={PARALLELISM}, {args.keys:,} keys of heap state, "
          f"retain {args.retain}, {args.runs} timed batches; {load()} (2 cores, shared machine)", flush=True)
    spark_rows: dict[int, dict[str, float]] = {}
    try:
        if not args.no_spark:
            ship_by_value()
            spark = spark_session(args.master, "keygroups-bench-driver", shuffle_partitions=PARALLELISM,
                                  conf=dict(args.spark_conf))
            clock = SplitClock(spark)
            try:
                for mp in args.max_parallelism:
                    spark_rows[mp] = spark_view(spark, clock, mp, args, work, files)
            finally:
                spark.stop()
        harness_rows = {mp: harness_view(mp, args, files) for mp in args.max_parallelism}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    if spark_rows:
        print(f"\n== 1. KeyedJob on Spark: a {args.batch}-record batch, medians of {args.runs} (ms); {load()}")
        print(f"{'max p':>6}{'chk kept':>9}{'batch':>8}{'Spark jobs':>11}{'outside jobs':>13}{'  of it: plan':>14}"
              f"{'commit':>8}{'driver CPU':>11}{'floor batch':>12}{'floor outside':>14}{'keygroups own':>14}"
              f"{'reader incl.':>13}{'floor r. incl.':>15}  target ms (on outside jobs)")
        for mp, r in spark_rows.items():
            own = r["outside"] - r["floor_outside"]
            target = TARGETS.get(mp)
            verdict = "" if target is None else f"{target * 1e3:.0f} {'ok' if r['outside'] <= target else 'miss'}"
            print(f"{mp:>6}{r['retained']:>9}{r['wall'] * 1e3:>8.0f}{r['jobs'] * 1e3:>11.0f}{r['outside'] * 1e3:>13.0f}"
                  f"{r['plan'] * 1e3:>14.0f}{r['commit'] * 1e3:>8.0f}{r['driver_cpu'] * 1e3:>11.0f}"
                  f"{r['floor_wall'] * 1e3:>12.0f}{r['floor_outside'] * 1e3:>14.0f}{own * 1e3:>14.0f}"
                  f"{r['with_read'] * 1e3:>13.0f}{r['floor_with_read'] * 1e3:>15.0f}  {verdict}")
        print("  outside jobs: run_batch's driver wall time over an input built before it, while none of its Spark "
              "jobs ran (the figure the target names); keygroups own: that minus the floor's outside-jobs time over "
              "the same file; reader included: outside jobs plus building the input with spark.read.parquet (its "
              "listing and schema inference, outside its jobs), as earlier versions of this benchmark timed it")
        print("\n   the same outside-jobs time, by what the driver's main thread waited for (medians, ms): 'JVM' = "
              "py4j calls and result reads outside jobs (Catalyst, job submission: Spark's "
              "side); 'Python' = the rest (keygroups' driver code, PySpark's Python wrappers, the commit's writes and fsyncs)")
        print(f"{'max p':>6}{'keygroups Python':>17}{'keygroups JVM':>14}{'py4j calls':>11}{'floor Python':>13}"
              f"{'floor JVM':>10}{'py4j calls':>11}{'Python over floor':>18}{'JVM over floor':>15}")
        for mp, r in spark_rows.items():
            print(f"{mp:>6}{r['python'] * 1e3:>17.0f}{r['jvm'] * 1e3:>14.0f}{r['calls']:>11.0f}"
                  f"{r['floor_python'] * 1e3:>13.0f}{r['floor_jvm'] * 1e3:>10.0f}{r['floor_calls']:>11.0f}"
                  f"{(r['python'] - r['floor_python']) * 1e3:>18.0f}{(r['jvm'] - r['floor_jvm']) * 1e3:>15.0f}")
        print("\n   CPU on the call's critical path (medians, ms): the JVM thread serving the driver's main Python thread "
              "(py4j's pinned thread; it waits without CPU while jobs run) and the main Python thread: less inflated "
              "by a loaded machine than the wall times above")
        print(f"{'max p':>6}{'keygroups JVM CPU':>18}{'Python CPU':>11}{'sum':>6}{'floor JVM CPU':>14}{'Python CPU':>11}"
              f"{'sum':>6}")
        for mp, r in spark_rows.items():
            ours_cpu, floor_cpu = r["jvm_cpu"] + r["python_cpu"], r["floor_jvm_cpu"] + r["floor_python_cpu"]
            print(f"{mp:>6}{r['jvm_cpu'] * 1e3:>18.1f}{r['python_cpu'] * 1e3:>11.1f}{ours_cpu * 1e3:>6.0f}"
                  f"{r['floor_jvm_cpu'] * 1e3:>14.1f}{r['floor_python_cpu'] * 1e3:>11.1f}{floor_cpu * 1e3:>6.0f}")
    print(f"\n== 2. KeyedFunctionHarness (no Spark): the driver's phases per {args.batch}-record batch, medians of "
          f"{args.runs} (ms); retains 1 checkpoint; {load()}")
    print(f"{'max p':>6}{'plan':>8}{'commit':>8}{'output':>8}{'driver total':>13}{'subtasks':>10}{'batch CPU':>10}"
          "  target ms")
    for mp, r in harness_rows.items():
        driver = r["plan"] + r["commit"] + r["output"]
        target = TARGETS.get(mp)
        verdict = "" if target is None else f"{target * 1e3:.0f} {'ok' if driver <= target else 'miss'}"
        print(f"{mp:>6}{r['plan'] * 1e3:>8.1f}{r['commit'] * 1e3:>8.1f}{r['output'] * 1e3:>8.1f}{driver * 1e3:>13.1f}"
              f"{r['subtasks'] * 1e3:>10.1f}{r['cpu'] * 1e3:>10.1f}  {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
