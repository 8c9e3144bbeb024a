"""Windows: keygroups' tumbling and session windows as keyed jobs beside Spark's native windowed aggregation
(Structured Streaming, ``groupBy(window(...))`` / ``session_window`` with a watermark), on the same events, same run.

Events: ``--events`` rows over ``--keys`` keys, in ``--batches`` Parquet files (one micro-batch each), event time
advancing ``--batch-seconds`` per batch with up to 2 s of disorder; value uniform in [0, 1000). Windows: tumbling
1 minute, sessions with a 30 s gap; count and sum per window; watermark delay 5 s. Each system runs the batches in
order (Spark: ``maxFilesPerTrigger=1``, ``availableNow``); events/s = events / wall time of all batches. keygroups
runs at ``--parallelism`` and its last batch at twice that (a rescale Spark cannot do: its state is fixed to the
query's first shuffle partitions); its seconds and restored bytes are the cost of the rescale.

    PYTHONPATH=src python benchmarks/bench_windows.py --events 1000000 --keys 10000 --batches 5

Both also run as ``transformWithStateInPandas`` with event-time timers (:class:`TumblingWindowsTws`,
:class:`SessionWindowsTws`: what a user writes without a window API; RocksDB state store, as TWS requires).
``--check`` first compares every window the three systems emit on the same events (``--events 20000``).
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


def in_stream_order(paths: list[str]) -> None:
    """Give the files modification times 1 s apart in list order: Spark's file source takes files in order of
    modification time (second resolution here), and files written within one second would come in any order (a
    later batch first would make the earlier batches' events late)."""
    now = time.time()
    for i, path in enumerate(paths):
        os.utime(path, (now - len(paths) + i, now - len(paths) + i))


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
    in_stream_order(files)
    return files


def run_keygroups(spark, files, assigner, name, parallelism, location, collect=False) -> dict:
    job_def = window(assigner, input_schema=SCHEMA, key_columns="key", timestamp_column="ts").aggregate(
        Count(), Sum("value"))
    job = KeyedJob(name, "key", job_def.function, output_schema=job_def.output_schema, max_parallelism=128,
                   checkpoint_location=location, timestamp_column="ts",
                   watermark_strategy=WatermarkStrategy.for_bounded_out_of_orderness(datetime.timedelta(seconds=5)))
    seconds, rows, collected = [], 0, []
    for i, f in enumerate(files):
        p = parallelism * 2 if i == len(files) - 1 else parallelism
        started = time.perf_counter()
        result = job.run_batch(spark.read.parquet(f), parallelism=p)   # committed: the output files are written
        seconds.append(time.perf_counter() - started)
        rows += result.output.count()   # read back untimed (Spark's noop sink reads nothing back either)
        if collect:
            collected += [tuple(r) for r in result.output.collect()]
        if i == len(files) - 1:
            restored = sum(r.restored.bytes_read for r in result.reports)
    return {"seconds": seconds, "windows_out": rows, "rescale_batch_seconds": seconds[-1],
            "rescale_bytes_read": restored, "steady_batch_seconds": float(np.median(seconds[1:-1] or seconds)),
            **({"rows": collected} if collect else {})}


def event_stream(spark, directory):
    """The event files as a stream, one file per micro-batch, with the 5 s watermark."""
    return (spark.readStream.schema("key long, ts timestamp, value long").option("maxFilesPerTrigger", 1)
            .parquet(directory).withWatermark("ts", "5 seconds"))


def run_stream(frame, checkpoint, table=None) -> dict:
    """Run a streaming query over all the files (append mode): to the noop sink, timed, or for --check into the
    in-memory table ``table``."""
    writer = (frame.writeStream.outputMode("append").option("checkpointLocation", checkpoint)
              .trigger(availableNow=True))
    writer = writer.format("memory").queryName(table) if table else writer.format("noop")
    started = time.perf_counter()
    writer.start().awaitTermination()
    return {"seconds": time.perf_counter() - started}


def run_spark(spark, directory, kind, checkpoint, table=None) -> dict:
    from pyspark.sql import functions as F

    group = F.window("ts", "1 minute") if kind == "tumbling" else F.session_window("ts", "30 seconds")
    counted = event_stream(spark, directory).groupBy(group, "key").agg(F.count("*").alias("n"),
                                                                       F.sum("value").alias("s"))
    if table:   # the windows as (key, start ms, end ms, n, s), as the others write them
        column = "window" if kind == "tumbling" else "session_window"
        counted = counted.select("key", F.unix_millis(F.col(f"{column}.start")).alias("start"),
                                 F.unix_millis(F.col(f"{column}.end")).alias("end"), "n", "s")
    return run_stream(counted, checkpoint, table)


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


class SessionWindowsTws:
    """The same session windows with ``transformWithStateInPandas``: a MapState session end -> (start, count, sum)
    per key, a batch's rows merged with the key's open sessions (gap 30 s; sessions that overlap or touch merge, as
    Flink and Spark's ``session_window``), and an event-time timer at each session's end - 1, moved when the session
    grows or merges, that emits and removes it."""

    gap_ms = 30_000

    def __new__(cls):   # built lazily: pyspark is imported in main()
        from pyspark.sql.streaming import StatefulProcessor

        class Processor(StatefulProcessor):
            def init(self, handle):
                self.handle = handle
                self.sessions = handle.getMapState("sessions", "end long", "start long, n long, s long")

            def handleInputRows(self, key, rows, timerValues):
                import pandas as pd

                gap = cls.gap_ms
                pdf = pd.concat(list(rows))
                ts = pdf["ts"].to_numpy().astype("datetime64[ms]").astype("int64")
                values = pdf["value"].to_numpy()
                watermark = timerValues.getCurrentWatermarkInMs()
                live = ts + gap - 1 > watermark   # a row whose own session has expired is late (as keygroups)
                order = np.argsort(ts[live], kind="stable")
                ts, values = ts[live][order], values[live][order]
                if not len(ts):
                    return iter([])
                # The batch's sessions: a new one wherever a row is more than the gap after the previous row.
                first = np.concatenate([[0], np.flatnonzero(np.diff(ts) > gap) + 1])
                last = np.concatenate([first[1:], [len(ts)]]) - 1
                fresh = list(zip(ts[first].tolist(), (ts[last] + gap).tolist(), np.diff(
                    np.concatenate([first, [len(ts)]])).tolist(), np.add.reduceat(values, first).tolist()))
                # The key's open sessions (those that fire at this watermark are emitted, not extended).
                stored = [(start, end, n, s) for (end,), (start, n, s) in self.sessions.iterator()
                          if end - 1 > watermark]
                merged: list[list] = []   # [start, end, n, s, stored sessions merged into it]
                for start, end, n, s, *origin in sorted([*fresh, *((*w, w) for w in stored)]):
                    if merged and start <= merged[-1][1]:
                        m = merged[-1]
                        m[1], m[2], m[3] = max(m[1], end), m[2] + n, m[3] + s
                        m[4] += origin
                    else:
                        merged.append([start, end, n, s, list(origin)])
                for start, end, n, s, origin in merged:
                    if len(origin) == 1 and origin[0] == (start, end, n, s):
                        continue   # a stored session no row of this batch reached
                    old_ends = [w[1] for w in origin]
                    for old_end in old_ends:
                        if old_end != end:   # merged away or grown: its state entry and timer move
                            self.sessions.removeKey((old_end,))
                            self.handle.deleteTimer(old_end - 1)
                    self.sessions.updateValue((end,), (start, n, s))
                    if end not in old_ends:
                        self.handle.registerTimer(end - 1)
                return iter([])

            def handleExpiredTimer(self, key, timerValues, expiredTimerInfo):
                import pandas as pd

                end = expiredTimerInfo.getExpiryTimeInMs() + 1
                start, n, s = self.sessions.getValue((end,))
                self.sessions.removeKey((end,))
                yield pd.DataFrame({"key": [key[0]], "start": [start], "end": [end], "n": [n], "s": [s]})

            def close(self):
                pass

        return Processor()


#: Each kind of window: the keygroups assigner and its transformWithStateInPandas processor.
KINDS = {"tumbling": (TumblingEventTimeWindows.of(datetime.timedelta(minutes=1)), TumblingWindowsTws),
         "session": (EventTimeSessionWindows.with_gap(datetime.timedelta(seconds=30)), SessionWindowsTws)}


def run_tws(spark, directory, kind, checkpoint, table=None) -> dict:
    spark.conf.set("spark.sql.streaming.stateStore.providerClass",
                   "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
    try:
        out = event_stream(spark, directory).groupBy("key").transformWithStateInPandas(
            statefulProcessor=KINDS[kind][1](), outputStructType="key long, start long, end long, n long, s long",
            outputMode="Append", timeMode="EventTime")
        return run_stream(out, checkpoint, table)
    finally:
        spark.conf.unset("spark.sql.streaming.stateStore.providerClass")


def check_outputs(spark, files, work, parallelism, skip_tws) -> None:
    """--check: every window of keygroups, Spark native and transformWithStateInPandas on the same events, compared
    row for row. Two more files, one event each far later (key -1, left out of the comparison), move the watermark
    past every window so that each system has emitted them all (Spark fires in the batch after the one that moved
    its watermark)."""
    directory = os.path.join(work, "check-events")
    os.makedirs(directory)
    for f in files:
        shutil.copy(f, directory)
    check_files = [os.path.join(directory, os.path.basename(f)) for f in files]
    for i, days in enumerate((1, 2)):
        path = os.path.join(directory, f"part-{len(files) + i:05d}.parquet")
        pq.write_table(pa.table({"key": [-1], "ts": pa.array([START_MS + days * 86_400_000], pa.timestamp("ms", "UTC")),
                                 "value": [0]}, schema=SCHEMA), path)
        check_files.append(path)
    in_stream_order(check_files)
    for kind, (assigner, _) in KINDS.items():
        outputs = {"keygroups": run_keygroups(spark, check_files, assigner, f"check-{kind}", parallelism,
                                              os.path.join(work, f"check-kg-{kind}"), collect=True)["rows"]}
        run_spark(spark, directory, kind, os.path.join(work, f"check-spark-{kind}"), table=f"check_spark_{kind}")
        outputs["spark native"] = [tuple(r) for r in spark.table(f"check_spark_{kind}").collect()]
        if not skip_tws:
            run_tws(spark, directory, kind, os.path.join(work, f"check-tws-{kind}"), table=f"check_tws_{kind}")
            outputs["transformWithStateInPandas"] = [tuple(r) for r in spark.table(f"check_tws_{kind}").collect()]
        outputs = {who: sorted(r for r in rows if r[0] != -1) for who, rows in outputs.items()}
        ours = outputs["keygroups"]
        print(f"check {kind:9s} keygroups {len(ours):,} windows, {sum(r[3] for r in ours):,} events, value sum "
              f"{sum(r[4] for r in ours):,}; " + "; ".join(
                  f"{who} {'equal' if rows == ours else f'DIFFERENT ({len(rows):,} windows)'}"
                  for who, rows in outputs.items() if who != "keygroups"), flush=True)


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
    parser.add_argument("--check", action="store_true",
                        help="first compare every window of the three systems (keep --events small), then time them")
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
        if args.check:
            check_outputs(spark, files, work, args.parallelism, args.skip_tws)
        for kind, (assigner, _) in KINDS.items():
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
                        f"{theirs['events_per_second']:>10,.0f} ev/s   rescale batch "
                        f"{ours['rescale_batch_seconds']:.2f} s vs steady {ours['steady_batch_seconds']:.2f} s, "
                        f"{ours['rescale_bytes_read']:,} bytes read")
                if not args.skip_tws:
                    tws = run_tws(spark, events_dir, kind, os.path.join(work, f"tws-{kind}-{run}"))
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
                print(f"median of {args.runs}: {kind:9s} transformWithStateInPandas {med['tws']:>8,.0f} ev/s   "
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
