"""Spark keyBy layer: key-group columns and exact placement, against Spark's own floor.

Side by side, on one warm local[2] session, each the median of ``--runs`` runs after one warm-up run, every
candidate forced the same way (``write.format("noop")``, which evaluates every column of every row and writes
nothing):

key-group column, on 10M ``LongType`` keys from ``spark.range`` and on 10M ``StringType`` keys (cached first, so
that generating the strings is not timed):
  (a)  ``with_key_groups``                 our default engine ("jvm": one Catalyst expression calling the JDK's
                                           own hashCode methods, code-generated)
  (a') ``with_key_groups(engine="sql")``   the portable engine (SQL text only, also over Spark Connect)
  (a") ``with_key_groups(engine="arrow")`` the compiled kernels over Arrow batches (scalar ``arrow_udf``)
  (b)  ``pmod(hash(k), max_parallelism)``  Spark's native hash: not Flink-exact, the floor of what Spark can do
  (c)  ``pandas_udf``                      a numpy implementation of the same Flink arithmetic
placement (shuffle to ``--parallelism`` partitions):
  (d)  ``partition_by_key_group``          ``repartitionById`` on the operator index: the same columns as (e)
  (d') ``partition_by_key_group(key_group_col="key_group")``  and the key-group column, computed after the shuffle
  (d") ``partition_by_key_group(method="hash")``  the Spark 4.0 route: hash partitioning on a stand-in
  (e)  ``df.repartition(parallelism, k)``  Spark's own hash partitioning on the key

Targets (issue 3): (a)/(b) <= 1.5 for integer keys, <= 3 for string keys; (d)/(e) <= 1.3.

With ``--connect``, every section also runs over a Spark Connect session served by the same JVM (no py4j gateway
there, so ``with_key_groups``' "auto" engine is the portable one), beside the classic figures:
  (f)  Connect: ``pmod(hash(k), max_parallelism)``     Spark's native hash over Connect
  (f') Connect: ``with_key_groups``                    "auto": "sql" (or "arrow" for binary keys)
  (f") Connect: ``with_key_groups(engine='arrow')``
  (g)  Connect: ``df.repartition(parallelism, k)``
  (g') Connect: ``partition_by_key_group``              and ``(g")`` with ``method='hash'``

    python benchmarks/bench_spark_keyby.py [--rows 10000000] [--runs 3] [--connect]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import pandas as pd
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.functions import pandas_udf

from keygroups.spark import partition_by_key_group, with_key_groups
from keygroups.spark.local_connect import connect_mode, local_connect_session, stop_local_connect
from keygroups.spark.partitioner import spark_hash_int

# ---- (c): the same Flink arithmetic in numpy, inside a pandas_udf ------------------------------------------------


def _np_murmur_key_groups(h: np.ndarray, max_parallelism: int) -> np.ndarray:
    """Flink's murmurHash(int) and key group over a uint32 array of Java hashes, in numpy. Flink's murmur is
    MurmurHash3_x86_32 of one int with seed 0, which is Spark's hashInt with seed 0."""
    signed = spark_hash_int(h.view(np.int32), seed=0).astype(np.int64)
    non_negative = np.where(signed == -(2**31), 0, np.abs(signed))
    return (non_negative % max_parallelism).astype(np.int32)


def numpy_long_udf(max_parallelism: int) -> Callable:
    @pandas_udf("int")
    def key_group(keys: pd.Series) -> pd.Series:
        v = keys.to_numpy(dtype=np.int64).view(np.uint64)
        h = (v ^ (v >> np.uint64(32))).astype(np.uint32)
        return pd.Series(_np_murmur_key_groups(h, max_parallelism))

    return key_group


def numpy_string_udf(max_parallelism: int) -> Callable:
    @pandas_udf("int")
    def key_group(keys: pd.Series) -> pd.Series:
        # String.hashCode over the code points of a numpy 'U' array: UTF-16 units for BMP text (the keys here).
        arr = keys.to_numpy(dtype=str)
        width = max(arr.dtype.itemsize // 4, 1)
        chars = arr.view(np.uint32).reshape(len(arr), width) if len(arr) else np.zeros((0, 1), np.uint32)
        lengths = np.char.str_len(arr)
        h = np.zeros(len(arr), dtype=np.uint32)
        with np.errstate(over="ignore"):
            for j in range(width):
                h = np.where(j < lengths, h * np.uint32(31) + chars[:, j], h)
        return pd.Series(_np_murmur_key_groups(h, max_parallelism))

    return key_group


# ---- harness --------------------------------------------------------------------------------------------------------


def over_connect(make: Callable[[], DataFrame]) -> Callable[[], DataFrame]:
    """``make`` with pyspark.sql.functions building Connect Columns (PySpark picks the kind per process)."""

    def made() -> DataFrame:
        with connect_mode(True):
            return make()

    return made


def force(df: DataFrame) -> None:
    df.write.format("noop").mode("overwrite").save()


def measure_all(candidates: dict[str, Callable[[], DataFrame]], runs: int) -> dict[str, tuple[float, float]]:
    """(median, fastest) seconds per candidate. Runs are interleaved (round r runs every candidate once), so that load from
    other processes on a shared machine falls on all candidates alike rather than on whichever ran at a bad time."""
    for make in candidates.values():
        force(make())  # warm-up: JIT, Python workers, plan caches
    times: dict[str, list[float]] = {name: [] for name in candidates}
    for _ in range(runs):
        for name, make in candidates.items():
            df = make()
            t0 = time.perf_counter()
            force(df)
            times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(ts), min(ts)) for name, ts in times.items()}


def report(title: str, results: dict[str, tuple[float, float]], baseline: str, target: float | None) -> None:
    """Medians and their ratio to the baseline (the figure the targets are about); the fastest run and its ratio
    beside them, as a check on noise from other processes (noise only ever adds time)."""
    base, base_min = results[baseline]
    print(f"\n{title}")
    print(f"  {'':<48} {'median':>8}   {'ratio':>6}      {'fastest':>8}   {'ratio':>6}")
    for name, (t, t_min) in results.items():
        ratio = t / base
        mark = ""
        if target is not None and (name.startswith("(a) ") or name.startswith("(d) ")):
            mark = "  target <= %.1fx: %s" % (target, "MET" if ratio <= target else "MISSED")
        print(f"  {name:<48} {t:8.3f} s {ratio:6.2f}x      {t_min:8.3f} s {t_min / base_min:6.2f}x{mark}")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-parallelism", type=int, default=128)
    ap.add_argument("--parallelism", type=int, default=8)
    ap.add_argument("--skip-pandas", action="store_true", help="leave out (c), the slowest candidate")
    ap.add_argument("--keys", default="long,string", help="comma-separated: long, string")
    ap.add_argument("--connect", action="store_true", help="also run over a Spark Connect session (same JVM)")
    args = ap.parse_args()
    n, runs, mp, p = args.rows, args.runs, args.max_parallelism, args.parallelism

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("bench_spark_keyby")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.memory", "4g")
        .config("spark.sql.shuffle.partitions", str(p))
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    print(f"Spark {spark.version}, local[2], {n:,} rows, max_parallelism={mp}, parallelism={p}, median of {runs}")

    def inputs(session: SparkSession) -> tuple[DataFrame, DataFrame]:
        ints = session.range(n).withColumnRenamed("id", "k")
        strings = session.range(n).select(
            F.concat(F.lit("user-"), (F.col("id") * 7919 % 1_000_003).cast("string")).alias("k"))
        if "string" in args.keys:
            strings = strings.cache()
            strings.count()
        return ints, strings

    ints, strings = inputs(spark)
    connect = None
    if args.connect:
        with connect_mode(False):
            connect = local_connect_session(spark)
        with connect_mode(True):
            connect_ints, connect_strings = inputs(connect)
    sections = {
        "long": ("LongType keys (spark.range)", ints, numpy_long_udf(mp), 1.5),
        "string": ("StringType keys (cached)", strings, numpy_string_udf(mp), 3.0),
    }
    for key in args.keys.split(","):
        label, df, udf, target = sections[key]
        cdf = (connect_ints if key == "long" else connect_strings) if connect is not None else None
        columns: dict[str, Callable[[], DataFrame]] = {
            "(b) pmod(hash(k), max_parallelism)": lambda df=df: df.withColumn(
                "key_group", F.pmod(F.hash("k"), F.lit(mp))
            ),
            "(a) with_key_groups": lambda df=df: with_key_groups(df, "k", max_parallelism=mp),
            "(a') with_key_groups(engine='sql')": lambda df=df: with_key_groups(
                df, "k", max_parallelism=mp, engine="sql"
            ),
            "(a\") with_key_groups(engine='arrow')": lambda df=df: with_key_groups(
                df, "k", max_parallelism=mp, engine="arrow"
            ),
        }
        if not args.skip_pandas:
            columns["(c) pandas_udf, numpy"] = lambda df=df, udf=udf: df.withColumn("key_group", udf("k"))
        if cdf is not None:
            columns["(f) Connect: pmod(hash(k), max_parallelism)"] = over_connect(
                lambda: cdf.withColumn("key_group", F.pmod(F.hash("k"), F.lit(mp))))
            columns["(f') Connect: with_key_groups"] = over_connect(
                lambda: with_key_groups(cdf, "k", max_parallelism=mp))
            columns["(f\") Connect: with_key_groups(engine='arrow')"] = over_connect(
                lambda: with_key_groups(cdf, "k", max_parallelism=mp, engine="arrow"))
        report(f"key-group column, {label}", measure_all(columns, runs), "(b) pmod(hash(k), max_parallelism)", target)

        placement: dict[str, Callable[[], DataFrame]] = {
            "(e) df.repartition(parallelism, k)": lambda df=df: df.repartition(p, "k"),
            "(d) partition_by_key_group": lambda df=df: partition_by_key_group(
                df, "k", max_parallelism=mp, parallelism=p
            ),
            "(d') partition_by_key_group(key_group_col=...)": lambda df=df: partition_by_key_group(
                df, "k", max_parallelism=mp, parallelism=p, key_group_col="key_group"
            ),
            "(d\") partition_by_key_group(method='hash')": lambda df=df: partition_by_key_group(
                df, "k", max_parallelism=mp, parallelism=p, method="hash"
            ),
        }
        if cdf is not None:
            placement["(g) Connect: df.repartition(parallelism, k)"] = over_connect(lambda: cdf.repartition(p, "k"))
            placement["(g') Connect: partition_by_key_group"] = over_connect(
                lambda: partition_by_key_group(cdf, "k", max_parallelism=mp, parallelism=p))
            placement["(g\") Connect: partition_by_key_group(method='hash')"] = over_connect(
                lambda: partition_by_key_group(cdf, "k", max_parallelism=mp, parallelism=p, method="hash"))
        report(
            f"placement into {p} partitions, {label}", measure_all(placement, runs),
            "(e) df.repartition(parallelism, k)", 1.3,
        )
        print(f"  (load average after this section: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores)")

    strings.unpersist()
    if connect is not None:
        with connect_mode(True):
            connect_strings.unpersist()
            connect.stop()
        stop_local_connect(spark)
    spark.stop()


if __name__ == "__main__":
    main()
