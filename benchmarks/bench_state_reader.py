"""Reading keyed state as a DataFrame: ``format("keygroups")`` beside Spark's own ``format("statestore")``.

    python benchmarks/bench_state_reader.py [--keys 10000000] [--tws-keys 1000000] [--runs 3]

The state is the running (count, sum) per key of ``spark_tws_baseline.py``, one entry per key:

* keygroups: a ValueState ``countSum`` (``TupleSerializer(Int64, Int64)``, a struct column) of ``--keys`` keys,
  written as a savepoint by ``keygroups.spark.write_savepoint`` (4 subtasks, max parallelism 128; the write time is
  printed too). A state as a job's checkpoint holds it after a batch is read the same way (full blocks).
* Spark: the ValueState ``countSum`` (count long, sum long) of ``--tws-keys`` keys, written by the
  ``transformWithStateInPandas`` query of ``spark_tws_baseline.py`` (RocksDB state store, 4 shuffle partitions) from
  ``2 x --tws-keys`` events in 2 micro-batches. TWS calls Python once per key per batch, so its state is built at a
  size that fits a few minutes on this machine; the keygroups state is also read at that size.

Each read is a full scan into Spark's ``noop`` sink (every column materialized, nothing written), on one local[2]
session; the table gives the median of ``--runs`` interleaved runs after one warm-up, in rows (state entries) per
second. Both readers' row counts are checked against the written state.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _events import generate_events  # noqa: E402
from _util import measure  # noqa: E402
from spark_tws_baseline import STATE_NAME, build_session, run_tws  # noqa: E402

from pyspark.sql import SparkSession  # noqa: E402
from pyspark.sql import functions as F  # noqa: E402

import keygroups.spark as kspark  # noqa: E402
from keygroups.serializers import Int64Serializer, TupleSerializer  # noqa: E402
from keygroups.spark import StateColumn, write_savepoint  # noqa: E402

MAX_PARALLELISM = 128


def write_keygroups_state(spark: SparkSession, location: str, keys: int) -> float:
    """A savepoint ``bench`` of ``keys`` keys in ``location``; returns the seconds it took."""
    df = spark.range(keys).select(F.col("id").alias("key"),
                                  F.struct((F.col("id") % 7 + 1).alias("count"), (F.col("id") * 3).alias("sum"))
                                  .alias("countSum"))
    start = time.perf_counter()
    write_savepoint(df, location, "bench", key_columns="key", max_parallelism=MAX_PARALLELISM, parallelism=4,
                    states={STATE_NAME: StateColumn("countSum", serializer=TupleSerializer(Int64Serializer(),
                                                                                           Int64Serializer()))})
    return time.perf_counter() - start


def keygroups_reader(spark: SparkSession, location: str):
    return spark.read.format("keygroups").option("savepoint", "bench").option("state", STATE_NAME).load(location)


def statestore_reader(spark: SparkSession, checkpoint: str):
    return spark.read.format("statestore").option("stateVarName", STATE_NAME).load(checkpoint)


def scan(df) -> None:
    df.write.format("noop").mode("overwrite").save()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--keys", type=int, default=10_000_000, help="entries of the keygroups state")
    ap.add_argument("--tws-keys", type=int, default=1_000_000, help="entries of the transformWithState state")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--work-dir", default=None)
    args = ap.parse_args(argv)
    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="bench-state-reader-"))
    spark = build_session(driver_memory="4g")
    kspark.register(spark)
    try:
        big, small = str(work / "kg-big"), str(work / "kg-small")
        print(f"writing the keygroups savepoint of {args.keys:,} keys ...", flush=True)
        write_big = write_keygroups_state(spark, big, args.keys)
        print(f"  {write_big:.1f}s ({args.keys / write_big:,.0f} rows/s)", flush=True)
        write_keygroups_state(spark, small, args.tws_keys)

        events = work / "events"
        generate_events(events, 2 * args.tws_keys, args.tws_keys, 2)
        print(f"running transformWithStateInPandas over {2 * args.tws_keys:,} events ...", flush=True)
        tws = run_tws(spark, str(events), str(work / "tws"), 4)
        tws_keys = len(tws["state"])
        print(f"  {tws['seconds']:.1f}s, {tws_keys:,} keys in its state", flush=True)

        readers = {
            f"keygroups  {args.keys:>11,} entries": (keygroups_reader(spark, big), args.keys),
            f"keygroups  {args.tws_keys:>11,} entries": (keygroups_reader(spark, small), args.tws_keys),
            f"statestore {tws_keys:>11,} entries": (statestore_reader(spark, str(work / "tws")), tws_keys),
        }
        for label, (df, n) in readers.items():
            count = df.count()
            if count != n:
                raise RuntimeError(f"{label}: read {count:,} rows, the state holds {n:,}")
        partitions = {label: df.rdd.getNumPartitions() for label, (df, _) in readers.items()}
        timings = measure({label: (lambda df=df: scan(df)) for label, (df, _) in readers.items()}, runs=args.runs,
                          warmup=1)
    finally:
        spark.stop()
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n== reading a ValueState (count, sum) as a DataFrame, full scan into noop, local[2], median of "
          f"{args.runs}")
    print(f"{'reader':<36} {'partitions':>10} {'seconds':>9} {'rows/s':>12}")
    for label, (_, n) in readers.items():
        seconds = timings[label].seconds
        print(f"{label:<36} {partitions[label]:>10} {seconds:>9.2f} {n / seconds:>12,.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
