"""What recording a batch's metrics costs a micro-batch (issue 36: "metrics collection overhead <= 2% of a batch's
time"), beside the same batches with metrics off.

One Spark session (local[2]), two identical jobs (``RunningValue``: one ValueState per key, heap, ``--keys`` keys of
state loaded by one untimed batch each): one records its metrics (the default), the other has them off
(``job_metrics(job).enabled = False``). Then ``--rounds`` rounds of the SAME ``--events``-event batch at parallelism
``--parallelism``, run on both jobs in turn (the order alternating by round, after one untimed warm-up round).

Printed: per job the median batch wall time, driver CPU (this process's, ``resource.getrusage``) and JVM CPU (Spark's
driver and, in local mode, executors: /proc; the Python workers' CPU is in neither), and their ratios; then the recording call itself, timed inside every batch of
the job that records (it runs on the driver's thread after the commit, while Spark is idle, so its wall time is what
it adds to the batch): its median wall and CPU (``time.thread_time``), split into reading Spark's status store and
the rest (building the metrics from the commit and writing them beside the checkpoints), as a share of the median
batch. The A/B difference of two medians on a shared machine is noisier than the in-batch timing; both are shown.

    python benchmarks/bench_metrics_overhead.py                            # 100k keys, 10k-event batches, mp 128
    python benchmarks/bench_metrics_overhead.py --max-parallelism 4096     # per-key-group figures at 4096

The two jobs' outputs of the last round are compared row for row before any figure is printed.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _jobs import VALUE_OUTPUT, RunningValue  # noqa: E402


def build_session(master: str) -> Any:
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master(master).appName("keygroups-bench-metrics")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.shuffle.partitions", "4").config("spark.default.parallelism", "4")
             .config("spark.sql.execution.arrow.pyspark.enabled", "true").config("spark.driver.memory", "2g")
             .config("spark.sql.session.timeZone", "UTC").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    return spark


class HookTimer:
    """Times every call of the recording listener a ``KeyedJob``'s batch spine makes after its commit that
    recorded a batch (the job with metrics off returns at once: not counted), and within it the reads of Spark's
    status store (the batch's Spark time and its keyed stage's tasks, ``spark_batch_times``), in place."""

    def __init__(self) -> None:
        import keygroups.spark.metrics as metrics_module

        self.calls: list[tuple[float, float]] = []        # (wall, thread CPU) of record_spark_batch
        self.store_reads: list[tuple[float, float]] = []  # of the status-store reads within each call
        hook, times = metrics_module.record_spark_batch, metrics_module.spark_batch_times
        reads: list[tuple[float, float]] = []

        def timed(function: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                w, c = time.perf_counter(), time.thread_time()
                try:
                    return function(*args, **kwargs)
                finally:
                    reads.append((time.perf_counter() - w, time.thread_time() - c))
            return call

        def timed_hook(job: Any, batch: Any, executor: Any) -> Any:
            reads.clear()
            wall, cpu = time.perf_counter(), time.thread_time()
            recorded = hook(job, batch, executor)
            if recorded is not None:
                self.calls.append((time.perf_counter() - wall, time.thread_time() - cpu))
                self.store_reads.append((sum(w for w, _ in reads), sum(c for _, c in reads)))
            return recorded

        metrics_module.record_spark_batch = timed_hook   # looked up by the listener at every call
        metrics_module.spark_batch_times = timed(times)


def jvm_cpu_seconds(spark: Any) -> float:
    """The CPU time of Spark's JVM so far (the driver's and, in local mode, the executors'), from /proc."""
    pid = spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")   # utime, stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--events", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--max-parallelism", type=int, default=128)
    parser.add_argument("--master", default="local[2]")
    args = parser.parse_args()

    timer = HookTimer()
    from keygroups.metrics import MetricsStore, job_metrics
    from keygroups.spark import KeyedJob

    spark = build_session(args.master)
    root = tempfile.mkdtemp(prefix="keygroups-bench-metrics-")
    jobs = {}
    for label in ("metrics off", "metrics on"):
        job = KeyedJob(label.replace(" ", "-"), "key", RunningValue(), output_schema=VALUE_OUTPUT,
                       max_parallelism=args.max_parallelism, checkpoint_location=os.path.join(root, label[8:]))
        job_metrics(job).enabled = label == "metrics on"
        jobs[label] = job
    rng = np.random.default_rng(7)
    print(f"keygroups metrics overhead: {args.keys:,} keys of heap state, {args.events:,}-event batches at "
          f"parallelism {args.parallelism}, max parallelism {args.max_parallelism}, {args.rounds} rounds, "
          f"{args.master}; machine shared (load average {os.getloadavg()[0]:.1f})", flush=True)
    load = spark.createDataFrame(pa.table({"key": np.arange(args.keys, dtype=np.int64),
                                           "value": np.ones(args.keys, dtype=np.int64)}).to_pandas())
    for label, job in jobs.items():
        start = time.perf_counter()
        job.run_batch(load, parallelism=args.parallelism)
        print(f"  {label}: state loaded in {time.perf_counter() - start:.1f} s", flush=True)
    in_batch: list[tuple[float, float]] = []   # the listener's own call inside the batch (hands off to a thread)
    driver = jobs["metrics on"].driver
    listener = driver.on_commit

    def timed_listener(batch: Any, executor: Any) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        listener(batch, executor)
        in_batch.append((time.perf_counter() - wall, time.thread_time() - cpu))

    driver.on_commit = timed_listener
    timer.calls.clear()
    timer.store_reads.clear()

    walls: dict[str, list[float]] = {label: [] for label in jobs}
    cpus: dict[str, list[float]] = {label: [] for label in jobs}
    jvm_cpus: dict[str, list[float]] = {label: [] for label in jobs}
    outputs: dict[str, Any] = {}
    for round_no in range(args.rounds + 1):
        keys = rng.integers(0, args.keys, args.events, dtype=np.int64)
        batch = spark.createDataFrame(pa.table({"key": keys, "value": rng.integers(1, 100, args.events)}).to_pandas())
        batch = batch.cache()
        batch.count()   # the same rows for both jobs, read from memory
        order = list(jobs) if round_no % 2 == 0 else list(reversed(jobs))
        for label in order:
            cpu = resource.getrusage(resource.RUSAGE_SELF)
            jvm = jvm_cpu_seconds(spark)
            start = time.perf_counter()
            result = jobs[label].run_batch(batch, parallelism=args.parallelism)
            wall = time.perf_counter() - start
            after = resource.getrusage(resource.RUSAGE_SELF)
            jvm_after = jvm_cpu_seconds(spark)
            if round_no:   # round 0 warms up
                walls[label].append(wall)
                cpus[label].append(after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime)
                jvm_cpus[label].append(jvm_after - jvm)
            if round_no == args.rounds:
                outputs[label] = sorted(tuple(r) for r in result.output.collect())
            print(f"  {'warm-up' if not round_no else f'round {round_no}':<9} {label:<12} {wall:6.3f} s", flush=True)
        batch.unpersist()
        if round_no == 0:
            job_metrics(jobs["metrics on"]).flush()
            in_batch.clear()
            timer.calls.clear()
            timer.store_reads.clear()
    if outputs["metrics on"] != outputs["metrics off"]:
        raise SystemExit("the two jobs' outputs differ: the benchmark measured different work")
    job_metrics(jobs["metrics on"]).flush()   # recorded in the background: its last batch's recording done
    recorded = MetricsStore(jobs["metrics on"].storage.location).checkpoint_ids()
    if len(recorded) != args.rounds + 2:
        raise SystemExit(f"the recording job kept {len(recorded)} batches, expected {args.rounds + 2}")

    med = {label: statistics.median(v) for label, v in walls.items()}
    cpu_med = {label: statistics.median(v) for label, v in cpus.items()}
    jvm_med = {label: statistics.median(v) for label, v in jvm_cpus.items()}
    print(f"\n== one {args.events:,}-event batch on {args.keys:,} keys (median of {args.rounds})")
    print(f"{'':<14}{'wall s':>10}{'driver CPU s':>14}{'JVM CPU s':>12}")
    for label in jobs:
        print(f"{label:<14}{med[label]:>10.3f}{cpu_med[label]:>14.3f}{jvm_med[label]:>12.3f}")
    print(f"{'on / off':<14}{med['metrics on'] / med['metrics off']:>10.3f}"
          f"{cpu_med['metrics on'] / max(cpu_med['metrics off'], 1e-9):>14.3f}"
          f"{jvm_med['metrics on'] / max(jvm_med['metrics off'], 1e-9):>12.3f}")

    hook_wall = statistics.median(w for w, _ in timer.calls)
    hook_cpu = statistics.median(c for _, c in timer.calls)
    read_wall = statistics.median(w for w, _ in timer.store_reads)
    read_cpu = statistics.median(c for _, c in timer.store_reads)
    print(f"\n== the recording call, inside each batch of the recording job (median of {len(timer.calls)})")
    print(f"{'':<44}{'wall ms':>10}{'CPU ms':>10}{'of a batch':>12}")
    print(f"{'record_spark_batch (all of it)':<44}{hook_wall * 1e3:>10.2f}{hook_cpu * 1e3:>10.2f}"
          f"{hook_wall / med['metrics on']:>12.2%}")
    print(f"{'  reading Spark status store':<44}{read_wall * 1e3:>10.2f}{read_cpu * 1e3:>10.2f}"
          f"{read_wall / med['metrics on']:>12.2%}")
    rest_wall, rest_cpu = hook_wall - read_wall, hook_cpu - read_cpu
    print(f"{'  building the metrics, writing them':<44}{rest_wall * 1e3:>10.2f}{rest_cpu * 1e3:>10.2f}"
          f"{rest_wall / med['metrics on']:>12.2%}")
    call_wall = statistics.median(w for w, _ in in_batch)
    call_cpu = statistics.median(c for _, c in in_batch)
    print(f"  (record_spark_batch runs on the recorder's background thread: off the batch's critical path)")
    print(f"{'in-batch listener call (hand-off + wait)':<44}{call_wall * 1e3:>10.2f}{call_cpu * 1e3:>10.2f}"
          f"{call_wall / med['metrics on']:>12.2%}")
    print(f"target: <= 2% of a batch -> {'met' if call_wall / med['metrics on'] <= 0.02 else 'NOT met'} "
          f"({call_wall / med['metrics on']:.2%} in-batch; A/B medians {med['metrics on'] / med['metrics off'] - 1:+.2%})")
    spark.stop()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
