"""The keyed stage's Catalyst work per micro-batch, the plan re-rooted resolved (analysed, constants folded: the
current path) beside the former re-rooting over a projection of aliases (analysed and optimized again each batch),
in one Spark session, the batches of the two interleaved (issue 32, the driver's time outside Spark's jobs).

    python benchmarks/bench_stage_plan.py --batches 15

Two ``KeyedJob`` s (:class:`_jobs.RunningValue`, heap, max parallelism ``--max-parallelism``, p=2) loaded with
``--keys`` keys, then ``--batches`` tiny batches each (10 records, one Parquet file), alternately, the order of the
two swapped every batch. Printed per path: the median ``run_batch`` wall time and driver CPU, and the medians of
Spark's own phase timings for the keyed stage's query (``QueryExecution.tracker``: analysis, optimization,
planning); then the median of the paired differences (former minus current), which a shared machine's load moves
less than either figure. Then Catalyst alone, ``--catalyst`` interleaved rounds: each path's plan put on a fresh
input and planned to its executed plan, nothing run (the JVM work of a batch outside its job, but for
submission). The former path is made by switching off, for its job's plan only, the two steps that make the
current one (:meth:`KeyedStagePlan._resolved_rooting` and :func:`_folded`).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import tempfile
import time

import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _jobs import VALUE_OUTPUT, RunningValue, ship_by_value  # noqa: E402
from _peers import load, spark_session  # noqa: E402

PHASES = ("analysis", "optimization", "planning")


def _tiny(path: str, start: int) -> str:
    pq.write_table(pa.table({"key": pa.array(range(start, start + 10), pa.int64()),
                             "value": pa.array([1] * 10, pa.int64()), "ts": pa.array([0] * 10, pa.int64())}), path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=15)
    parser.add_argument("--keys", type=int, default=20_000)
    parser.add_argument("--max-parallelism", type=int, default=128)
    parser.add_argument("--catalyst", type=int, default=60, help="interleaved rounds of planning alone")
    args = parser.parse_args(argv)

    from pyspark.sql import functions as F

    from keygroups.spark import KeyedJob
    from keygroups.spark import executor

    ship_by_value()
    spark = spark_session()
    work = pathlib.Path(tempfile.mkdtemp(prefix="bench-stage-plan-"))
    keys = spark.range(0, args.keys, numPartitions=2).select(
        F.col("id").alias("key"), F.lit(1).cast("long").alias("value"), F.lit(0).cast("long").alias("ts"))
    rooting, folded = executor.KeyedStagePlan._resolved_rooting, executor._folded
    jobs = {}
    for name in ("former", "current"):
        if name == "former":   # this job's plan only: it is made (and cached) by its first batches below
            executor.KeyedStagePlan._resolved_rooting = lambda *a: None   # type: ignore[method-assign]
            executor._folded = lambda jvm, plan: plan
        else:
            executor.KeyedStagePlan._resolved_rooting, executor._folded = rooting, folded  # type: ignore[method-assign]
        job = jobs[name] = KeyedJob(f"stage-{name}", "key", RunningValue(), output_schema=VALUE_OUTPUT,
                                    max_parallelism=args.max_parallelism,
                                    checkpoint_location=str(work / name), retain=10)
        job.run_batch(keys, parallelism=2)
        for i in range(3):   # the plan made, the session warm
            job.run_batch(spark.read.parquet(_tiny(str(work / f"warm-{name}-{i}.parquet"), i)), parallelism=2)
        plans = [p for p in job._plans.stages.values() if p is not None]
        if not plans or (plans[0]._attribute_map is None) != (name == "former"):
            raise SystemExit(f"the {name} job did not take the {name} path")

    keyed = {}
    run_keyed = executor.SparkExecutor.run_keyed

    def noting(self):  # noqa: ANN001, ANN202
        keyed["df"] = self._keyed
        return run_keyed(self)

    executor.SparkExecutor.run_keyed = noting  # type: ignore[method-assign]
    wall: dict[str, list[float]] = {n: [] for n in jobs}
    cpu: dict[str, list[float]] = {n: [] for n in jobs}
    phases: dict[str, dict[str, list[int]]] = {n: {p: [] for p in PHASES} for n in jobs}
    print(f"{args.batches} interleaved batches of 10 records, max p {args.max_parallelism}, {args.keys:,} keys; "
          f"{load()} (2 cores, shared machine)", flush=True)
    for i in range(args.batches):
        path = _tiny(str(work / f"in-{i}.parquet"), i)
        for name in (("former", "current") if i % 2 == 0 else ("current", "former")):
            df = spark.read.parquet(path)
            c, t = time.process_time(), time.perf_counter()
            jobs[name].run_batch(df, parallelism=2)
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
            tracked = keyed["df"]._jdf.queryExecution().tracker().phases()
            for p in PHASES:
                phases[name][p].append(tracked.apply(p).durationMs() if tracked.contains(p) else 0)
    med = statistics.median
    print(f"\n{'path':>8} {'wall ms':>8} {'CPU ms':>7} " + " ".join(f"{p + ' ms':>15}" for p in PHASES))
    for name in jobs:
        print(f"{name:>8} {med(wall[name]) * 1e3:8.1f} {med(cpu[name]) * 1e3:7.1f} "
              + " ".join(f"{med(phases[name][p]):15.1f}" for p in PHASES))
    paired = [a - b for a, b in zip(wall["former"], wall["current"])]
    print(f"\npaired wall difference, former minus current: median {med(paired) * 1e3:.1f} ms; ratio of medians "
          f"{med(wall['current']) / med(wall['former']):.2f}; {load()}")

    # Catalyst alone, without running anything: each plan put on a fresh input (analysis, for the former path),
    # then optimized and planned, --catalyst times, interleaved
    stages = {n: next(p for p in jobs[n]._plans.stages.values() if p is not None) for n in jobs}
    jsession = keyed["df"]._jdf.sparkSession()   # the keyed stage's session (the clone without AQE)
    df = spark.read.parquet(path)
    catalyst: dict[str, list[float]] = {n: [] for n in jobs}
    for i in range(args.catalyst):
        for name in (("former", "current") if i % 2 == 0 else ("current", "former")):
            t = time.perf_counter()
            staged, _ = stages[name].on(df, jsession)
            staged._jdf.queryExecution().executedPlan()
            catalyst[name].append(time.perf_counter() - t)
    pairs = [a - b for a, b in zip(catalyst["former"], catalyst["current"])]
    print(f"Catalyst alone (put on the input, analysed, optimized, planned; {args.catalyst} interleaved, medians): "
          f"former {med(catalyst['former']) * 1e3:.1f} ms, current {med(catalyst['current']) * 1e3:.1f} ms, "
          f"ratio {med(catalyst['current']) / med(catalyst['former']):.2f}, paired difference "
          f"{med(pairs) * 1e3:.1f} ms; {load()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
