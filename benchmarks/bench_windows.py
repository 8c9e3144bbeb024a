"""Windows: keygroups' tumbling and session windows as keyed jobs beside Spark's native windowed aggregation
(Structured Streaming, ``groupBy(window(...))`` / ``session_window`` with a watermark), on the same events, same run.

Events: ``--events`` rows over ``--keys`` keys, in ``--batches`` Parquet files (one micro-batch each), event time
advancing ``--batch-seconds`` per batch with up to 2 s of disorder; value uniform in [0, 1000). Windows: tumbling
1 minute, sessions with a 30 s gap; count and sum per window; watermark delay 5 s. Each system runs the batches in
order (Spark: ``maxFilesPerTrigger=1``, ``availableNow``); events/s = events / wall time of all batches. keygroups
runs at ``--parallelism`` and its last batch at twice that (a rescale Spark cannot do: its state is fixed to the
query's first shuffle partitions); its seconds and restored bytes are the cost of the rescale.

    PYTHONPATH=src python benchmarks/bench_windows.py --events 1000000 --keys 10000 --batches 5

Tumbling windows also run as ``transformWithStateInPandas`` with event-time timers (:class:`TumblingWindowsTws`,
RocksDB state store, as TWS requires); sessions do not (a hand-written session merge in TWS is not measured).
Everything starts after an untimed warm-up of both systems (Python workers, first job).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from keygroups.runtime import WatermarkStrategy
from keygroups.spark import KeyedJob
from keygroups.windows import Count, EventTimeSessionWindows, Sum, TumblingEventTimeWindows, window

SCHEMA = pa.schema([("key", pa.int64()), ("ts", pa.timestamp("ms", "UTC")), ("value", pa.int64())])
START_MS = 1_767_225_600_000   # 2026-01-01T00:00:00Z


def write_events(directory: str, events: int, keys: int, batches: int, batch_seconds: int) -> list[str]:
    rng = np.random.default_rng(42)
    files = []
    per = events // batches
    for b in range(batches):
        base = START_MS + b * batch_seconds * 1000
        ts = np.sort(rng.integers(base, base + batch_seconds * 1000, per)) - rng.integers(0, 2000, per)
        table = pa.table({"key": rng.integers(0, keys, per), "ts": pa.array(ts, pa.timestamp("ms", "UTC")),
                          "value": rng.integers(0, 1000, per)}, schema=SCHEMA)
        path = os.path.join(directory, f"part-{b:05d}.parquet")
        pq.write_table(table, path)
        files.append(path)
    return files


def run_keygroups(spark, files, assigner, name, parallelism, location) -> dict:
    job_def = window(assigner, input_schema=SCHEMA, key_columns="key", timestamp_column="ts").aggregate(
        Count(), Sum("value"))
    job = KeyedJob(name, "key", job_def.function, output_schema=job_def.output_schema, max_parallelism=128,
                   checkpoint_location=location, timestamp_column="ts",
                   watermark_strategy=WatermarkStrategy.for_bounded_out_of_orderness(datetime.timedelta(seconds=5)))
    seconds, rows = [], 0
    for i, f in enumerate(files):
        p = parallelism * 2 if i == len(files) - 1 else parallelism
        started = time.perf_counter()
        result = job.run_batch(spark.read.parquet(f), parallelism=p)   # committed: the output files are written
        seconds.append(time.perf_counter() - started)
        rows += result.output.count()   # read back untimed (Spark's noop sink reads nothing back either)
        if i == len(files) - 1:
            restored = sum(r["restored"]["bytes_read"] for r in result.reports)
    return {"seconds": seconds, "windows_out": rows, "rescale_batch_seconds": seconds[-1],
            "rescale_bytes_read": restored, "steady_batch_seconds": float(np.median(seconds[1:-1] or seconds))}


def run_spark(spark, directory, kind, checkpoint) -> dict:
    from pyspark.sql import functions as F

    stream = (spark.readStream.schema("key long, ts timestamp, value long").option("maxFilesPerTrigger", 1)
              .parquet(directory).withWatermark("ts", "5 seconds"))
    group = F.window("ts", "1 minute") if kind == "tumbling" else F.session_window("ts", "30 seconds")
    counted = stream.groupBy(group, "key").agg(F.count("*").alias("n"), F.sum("value").alias("s"))
    started = time.perf_counter()
    query = (counted.writeStream.outputMode("append").format("noop").option("checkpointLocation", checkpoint)
             .trigger(availableNow=True).start())
    query.awaitTermination()
    return {"seconds": time.perf_counter() - started}


class TumblingWindowsTws:
    """The same tumbling windows with ``transformWithStateInPandas``: a MapState window start -> (count, sum) per key
    and an event-time timer at each window's end - 1 that emits and removes it (what a user writes without a
    window API)."""

    size_ms = 60_000

    def __new__(cls):   # built lazily: pyspark is imported in main()
        from pyspark.sql.streaming import StatefulProcessor

        class Processor(StatefulProcessor):
            def init(self, handle):
                self.handle = handle
                self.windows = handle.getMapState("windows", "start long", "n long, s long")

            def handleInputRows(self, key, rows, timerValues):
                import pandas as pd

                size = cls.size_ms
                for pdf in rows:
                    ts = pdf["ts"].to_numpy().astype("datetime64[ms]").astype("int64")
                    starts = ts - ts % size
                    grouped = pd.DataFrame({"start": starts, "v": pdf["value"].to_numpy()}).groupby("start")["v"]
                    for start, n, s in zip(grouped.size().index.tolist(), grouped.size().tolist(),
                                           grouped.sum().tolist()):
                        if self.windows.containsKey((start,)):
                            old_n, old_s = self.windows.getValue((start,))
                            n, s = n + old_n, s + old_s
                        else:
                            self.handle.registerTimer(start + size - 1)
                        self.windows.updateValue((start,), (n, s))
                return iter([])

            def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
                import pandas as pd

                start = expiredTimerInfo.getExpiryTimeInMs() - cls.size_ms + 1
                n, s = self.windows.getValue((start,))
                self.windows.removeKey((start,))
                yield pd.DataFrame({"key": [key[0]], "start": [start], "end": [start + cls.size_ms], "n": [n],
                                    "s": [s]})

            def close(self):
                pass

        return Processor()


def run_tws(spark, directory, checkpoint) -> dict:
    spark.conf.set("spark.sql.streaming.stateStore.providerClass",
                   "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
    try:
        stream = (spark.readStream.schema("key long, ts timestamp, value long").option("maxFilesPerTrigger", 1)
                  .parquet(directory).withWatermark("ts", "5 seconds"))
        out = stream.groupBy("key").transformWithStateInPandas(
            statefulProcessor=TumblingWindowsTws(), outputStructType="key long, start long, end long, n long, s long",
            outputMode="Append", timeMode="EventTime")
        started = time.perf_counter()
        query = (out.writeStream.outputMode("append").format("noop").option("checkpointLocation", checkpoint)
                 .trigger(availableNow=True).start())
        query.awaitTermination()
        return {"seconds": time.perf_counter() - started}
    finally:
        spark.conf.unset("spark.sql.streaming.stateStore.providerClass")


def warm_up(spark, files, work) -> None:
    """Start Spark's Python workers and JIT before anything is timed (the first job of a session pays seconds)."""
    small = os.path.join(work, "warmup")
    os.makedirs(small)
    pq.write_table(pq.read_table(files[0]).slice(0, 10_000), os.path.join(small, "part-00000.parquet"))
    run_keygroups(spark, [os.path.join(small, "part-00000.parquet")] * 2,
                  TumblingEventTimeWindows.of(datetime.timedelta(minutes=1)), "warmup", 2,
                  os.path.join(work, "kg-warmup"))
    run_spark(spark, small, "tumbling", os.path.join(work, "spark-warmup"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--batch-seconds", type=int, default=300)
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3, help="runs of each; medians are printed")
    parser.add_argument("--json", help="write the figures here too")
    parser.add_argument("--skip-tws", action="store_true", help="leave out the transformWithStateInPandas baseline")
    args = parser.parse_args()
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (SparkSession.builder.master("local[2]").appName("bench-windows").config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false").config("spark.sql.session.timeZone", "UTC")
             .config("spark.sql.shuffle.partitions", str(args.parallelism))
             .config("spark.sql.execution.arrow.pyspark.enabled", "true").getOrCreate())
    work = tempfile.mkdtemp(prefix="bench-windows-")
    try:
        events_dir = os.path.join(work, "events")
        os.makedirs(events_dir)
        files = write_events(events_dir, args.events, args.keys, args.batches, args.batch_seconds)
        n = args.events // args.batches * args.batches
        figures: dict = {"events": n, "keys": args.keys, "batches": args.batches, "parallelism": args.parallelism}
        warm_up(spark, files, work)
        for kind, assigner in (("tumbling", TumblingEventTimeWindows.of(datetime.timedelta(minutes=1))),
                               ("session", EventTimeSessionWindows.with_gap(datetime.timedelta(seconds=30)))):
            runs: dict[str, list[dict]] = {"keygroups": [], "spark": [], "tws": []}
            for run in range(args.runs):
                ours = run_keygroups(spark, files, assigner, kind, args.parallelism,
                                     os.path.join(work, f"kg-{kind}-{run}"))
                theirs = run_spark(spark, events_dir, kind, os.path.join(work, f"spark-{kind}-{run}"))
                ours["events_per_second"] = n / sum(ours["seconds"])
                theirs["events_per_second"] = n / theirs["seconds"]
                runs["keygroups"].append(ours)
                runs["spark"].append(theirs)
                line = (f"run {run + 1} {kind:9s} keygroups {ours['events_per_second']:>10,.0f} ev/s   spark native "
                        f"{theirs['events_per_second']:>10,.0f} ev/s   rescale batch {ours['rescale_batch_seconds']:.2f} s "
                        f"vs steady {ours['steady_batch_seconds']:.2f} s, {ours['rescale_bytes_read']:,} bytes read")
                if kind == "tumbling" and not args.skip_tws:
                    tws = run_tws(spark, events_dir, os.path.join(work, f"tws-{run}"))
                    tws["events_per_second"] = n / tws["seconds"]
                    runs["tws"].append(tws)
                    line += f"   transformWithStateInPandas {tws['events_per_second']:>8,.0f} ev/s"
                print(line + f"   load {os.getloadavg()[0]:.1f}", flush=True)
            med = {who: float(np.median([r["events_per_second"] for r in rs])) for who, rs in runs.items() if rs}
            figures[kind] = {**runs, "median_events_per_second": med,
                             "ratio_spark_over_keygroups": med["spark"] / med["keygroups"]}
            print(f"median of {args.runs}: {kind:9s} keygroups {med['keygroups']:>10,.0f} ev/s   spark native "
                  f"{med['spark']:>10,.0f} ev/s   spark/keygroups {med['spark'] / med['keygroups']:.2f}x "
                  f"(target <= 2x)", flush=True)
            if "tws" in med:
                print(f"median of {args.runs}: tumbling  transformWithStateInPandas {med['tws']:>8,.0f} ev/s   "
                      f"keygroups/tws {med['keygroups'] / med['tws']:.2f}x (target >= 3x)", flush=True)
            rescale = [r["rescale_batch_seconds"] for r in runs["keygroups"]]
            steady = [r["steady_batch_seconds"] for r in runs["keygroups"]]
            print(f"median of {args.runs}: {kind:9s} rescale {args.parallelism} -> {2 * args.parallelism} batch "
                  f"{np.median(rescale):.2f} s vs steady {np.median(steady):.2f} s (Spark cannot change a streaming "
                  "query's state partitioning at all)", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(figures, f, indent=2)
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
