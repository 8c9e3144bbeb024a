"""Spark's own stateful baseline: per-key running count and sum through ``transformWithStateInPandas``.

The workload of issue 6 (default 5M events over 100k keys, see ``_events.py`` for the data) runs as a Structured
Streaming query:

    file source (Parquet, the event log directory, ``maxFilesPerTrigger`` files per micro-batch)
      -> groupBy("key").transformWithStateInPandas(RunningCountSum, timeMode="None", outputMode="Update")
         one ValueState "countSum" (count long, sum long) per key, RocksDBStateStoreProvider
         (transformWithState supports no other provider: it needs column families)
      -> noop sink, trigger(availableNow=True)

so every micro-batch is one Spark state checkpoint, like one keygroups checkpoint per micro-batch. Throughput is
events / wall time of the query (start to termination, planning included). After each run the state is read back
from the checkpoint with Spark's state data source (``format("statestore")``) and compared with pandas.

    python benchmarks/spark_tws_baseline.py --events 200000 --keys 10000      # development size
    python benchmarks/spark_tws_baseline.py                                   # 5M events, 100k keys

``run_tws(spark, events_dir, checkpoint_dir, shuffle_partitions)`` is the entry point for a side-by-side benchmark.

``run_tws_jvm`` builds the same state (ValueState "countSum" of (count, sum) per key, RocksDB) with a JVM
``transformWithState`` (``benchmarks/java/RepartitionStateTws.java``, compiled with ``javac`` against pyspark's jars
by ``jvm_classes()``; the session must have those classes on the driver's class path: ``build_session(
extra_classpath=[jvm_classes()])``): no Python per key, for the large states Spark's repartition is measured on.
``state_summary`` checks such a state through the state data source with aggregates and a sample, not pandas.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _events import compare_state, generate_events, read_manifest, reference_state  # noqa: E402

from pyspark.sql import SparkSession  # noqa: E402
from pyspark.sql.streaming import StatefulProcessor, StatefulProcessorHandle  # noqa: E402

ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
STATE_NAME = "countSum"
EVENT_SCHEMA = "key long, value long, ts long"
OUTPUT_SCHEMA = "key long, count long, sum long"
STATE_SCHEMA = "count long, sum long"


class RunningCountSum(StatefulProcessor):
    """One ValueState (count, sum) per key; emits the key's new totals once per micro-batch."""

    def init(self, handle: StatefulProcessorHandle) -> None:
        self.state = handle.getValueState(STATE_NAME, STATE_SCHEMA)

    def handleInputRows(self, key: Any, rows: Iterator[pd.DataFrame], timerValues: Any) -> Iterator[pd.DataFrame]:
        # get() is one call to the JVM state server and returns None for a new key; no separate exists() call.
        current = self.state.get()
        count, total = (int(current[0]), int(current[1])) if current is not None else (0, 0)
        for pdf in rows:
            values = pdf["value"].to_numpy()
            count += len(values)
            total += int(values.sum())
        self.state.update((count, total))
        yield pd.DataFrame({"key": [key[0]], "count": [count], "sum": [total]})

    def close(self) -> None:
        pass


def _ship_this_module() -> None:
    # Imported as a module (not run as a script), this file would be pickled to the Python workers by reference,
    # and they cannot import it from benchmarks/. Pickle it by value instead.
    if __name__ != "__main__":
        from pyspark import cloudpickle

        cloudpickle.register_pickle_by_value(sys.modules[__name__])


def build_session(master: str = "local[2]", driver_memory: str = "2g",
                  extra_classpath: list[str] | None = None) -> SparkSession:
    """The session the baseline is measured on: RocksDB state store, Arrow on, UI off; ``extra_classpath`` on the
    driver's class path (``jvm_classes()`` for ``run_tws_jvm``)."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.master(master)
        .appName("keygroups-tws-baseline")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", driver_memory)
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
    )
    if extra_classpath:
        builder = builder.config("spark.driver.extraClassPath", os.pathsep.join(extra_classpath))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def start_query(
    spark: SparkSession,
    events_dir: str,
    checkpoint_dir: str,
    *,
    max_files_per_trigger: int = 1,
    sink: str = "noop",
):
    """Start the TWS query over the files in ``events_dir`` (availableNow); returns the StreamingQuery."""
    _ship_this_module()
    events = (
        spark.readStream.schema(EVENT_SCHEMA)
        .option("maxFilesPerTrigger", max_files_per_trigger)
        .parquet(str(events_dir))
    )
    out = events.groupBy("key").transformWithStateInPandas(
        statefulProcessor=RunningCountSum(),
        outputStructType=OUTPUT_SCHEMA,
        outputMode="Update",
        timeMode="None",
    )
    return (
        out.writeStream.format(sink)
        .outputMode("update")
        .option("checkpointLocation", str(checkpoint_dir))
        .trigger(availableNow=True)
        .start()
    )


def state_frame(spark: SparkSession, checkpoint_dir: str) -> Any:
    """The ValueState of the latest committed batch through Spark's state data source: a DataFrame (key, count, sum).

    The grouping key is a struct of one field, named ``key`` by transformWithStateInPandas' groupBy("key") and
    ``value`` by the JVM query's groupByKey(Encoders.LONG()).
    """
    raw = spark.read.format("statestore").option("stateVarName", STATE_NAME).load(str(checkpoint_dir))
    key_field = raw.schema["key"].dataType.fieldNames()[0]
    return raw.selectExpr(f"key.`{key_field}` AS key", "value.count AS count", "value.sum AS sum")


def read_state(spark: SparkSession, checkpoint_dir: str) -> pd.DataFrame:
    """The ValueState of the latest committed batch, read from the checkpoint; index ``key``, columns count, sum."""
    pdf: pd.DataFrame = state_frame(spark, checkpoint_dir).toPandas()  # type: ignore[assignment]
    return pdf.set_index("key").sort_index().astype("int64")


def run_tws(
    spark: SparkSession,
    events_dir: str,
    checkpoint_dir: str,
    shuffle_partitions: int,
    *,
    max_files_per_trigger: int = 1,
) -> dict:
    """Run the baseline once from an empty checkpoint over all files of ``events_dir``.

    Returns events_per_s, seconds (query wall time), events and batches (from the query's progress, checked against
    the log's manifest when there is one), state (pandas, read back from the checkpoint: not timed).
    ``spark.sql.shuffle.partitions`` and the RocksDB provider are set on the session for the query's start (the
    partition count is then fixed for the life of this checkpoint) and restored afterwards.
    """
    ck = pathlib.Path(checkpoint_dir)
    if ck.exists() and any(ck.iterdir()):
        raise ValueError(f"checkpoint_dir {ck} is not empty; run_tws measures a run from empty state")
    with _rocksdb_query_conf(spark, shuffle_partitions):
        start = time.perf_counter()
        query = start_query(spark, events_dir, str(ck), max_files_per_trigger=max_files_per_trigger)
        query.awaitTermination()
        seconds = time.perf_counter() - start
    if query.exception() is not None:
        raise RuntimeError(f"transformWithStateInPandas query failed: {query.exception()}")
    progress = [p for p in query.recentProgress if p["numInputRows"] > 0]
    events = sum(p["numInputRows"] for p in progress)
    try:
        expected = read_manifest(events_dir)["n_events"]
    except FileNotFoundError:
        expected = events
    if events != expected:
        raise RuntimeError(f"the query read {events} events, the log has {expected}")
    return {
        "events_per_s": events / seconds,
        "seconds": seconds,
        "events": events,
        "batches": len(progress),
        "shuffle_partitions": shuffle_partitions,
        "state": read_state(spark, str(ck)),
    }


# ---- the same state built in the JVM -------------------------------------------------------------------------------

JVM_SOURCE = "RepartitionStateTws.java"
# Checksums of a state over bounded terms (Spark's sum of longs fails on overflow in ANSI mode): with the row count,
# sum(count) and min/max(count), a key missing, doubled or holding another key's value changes at least one of them.
_CHECKSUMS = {
    "rows": "count(*)",
    "sum_count": "sum(count)",
    "min_count": "min(count)",
    "max_count": "max(count)",
    "sum_sum": "sum(sum)",
    "sum_key": "sum(key % 1000003)",
    "key_x_sum": "sum((key % 1000003) * sum)",
    "key_x_key": "sum(((key % 999983) * (key % 1000003)) % 1000033)",
}


def jvm_classes() -> str:
    """The directory of RepartitionStateTws' classes, compiled against pyspark's jars (cached)."""
    from _peers import build_java, spark_classpath

    return build_java(JVM_SOURCE, spark_classpath())


def run_tws_jvm(
    spark: SparkSession,
    events_dir: str,
    checkpoint_dir: str,
    shuffle_partitions: int,
    *,
    max_files_per_trigger: int = 1_000_000,
) -> dict:
    """Build the ValueState "countSum" (count, sum) per key of the events in ``events_dir`` (Parquet, key and value
    long) with the JVM transformWithState of RepartitionStateTws, RocksDB provider, ``shuffle_partitions`` state
    partitions, from an empty ``checkpoint_dir``; by default all files in one micro-batch.

    Returns seconds (query wall time), events, batches. The session conf is restored afterwards.
    """
    ck = pathlib.Path(checkpoint_dir)
    if ck.exists() and any(ck.iterdir()):
        raise ValueError(f"checkpoint_dir {ck} is not empty; run_tws_jvm builds state from empty")
    jvm = spark.sparkContext._jvm
    assert jvm is not None
    if not _has_class(spark):
        raise RuntimeError("RepartitionStateTws is not on the driver's class path: start the session with "
                           "build_session(extra_classpath=[jvm_classes()]) (spark.driver.extraClassPath must be set "
                           "before the JVM starts)")
    with _rocksdb_query_conf(spark, shuffle_partitions):
        start = time.perf_counter()
        query = jvm.RepartitionStateTws.start(spark._jsparkSession, str(events_dir), str(ck),
                                              int(max_files_per_trigger))
        query.awaitTermination()
        seconds = time.perf_counter() - start
    if query.exception().isDefined():
        raise RuntimeError(f"the JVM transformWithState query failed: {query.exception().get().toString()}")
    progress = [p for p in query.recentProgress() if p.numInputRows() > 0]
    return {"seconds": seconds, "events": sum(p.numInputRows() for p in progress), "batches": len(progress),
            "shuffle_partitions": shuffle_partitions}


@contextlib.contextmanager
def _rocksdb_query_conf(spark: SparkSession, shuffle_partitions: int) -> Iterator[None]:
    """The RocksDB state store provider and ``shuffle_partitions`` set on the session while a query starts and runs;
    the caller's values back afterwards (the query captured its conf when it started)."""
    keys = ("spark.sql.streaming.stateStore.providerClass", "spark.sql.shuffle.partitions")
    saved = {k: spark.conf.get(k) for k in keys}
    spark.conf.set(keys[0], ROCKSDB_PROVIDER)
    spark.conf.set(keys[1], str(shuffle_partitions))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is not None:
                spark.conf.set(k, v)


def _has_class(spark: SparkSession) -> bool:
    jvm = spark.sparkContext._jvm
    try:
        jvm.java.lang.Class.forName("RepartitionStateTws", False,
                                    jvm.Thread.currentThread().getContextClassLoader())
        return True
    except Exception:
        return False


def state_summary(spark: SparkSession, checkpoint_dir: str, sample_keys: list[int] | None = None) -> dict:
    """Checksums of the state (see _CHECKSUMS), computed by Spark over the state data source, and, for
    ``sample_keys``, their (count, sum) as {key: (count, sum)}."""
    frame = state_frame(spark, checkpoint_dir)
    row = frame.selectExpr(*(f"{expr} AS {name}" for name, expr in _CHECKSUMS.items())).collect()[0]
    out: dict = {name: int(row[name]) if row[name] is not None else None for name in _CHECKSUMS}
    if sample_keys:
        got = frame.where(frame.key.isin([int(k) for k in sample_keys])).collect()
        out["sample"] = {int(r["key"]): (int(r["count"]), int(r["sum"])) for r in got}
    return out


def expected_summary(keys: Any, values: Any, sample_keys: list[int] | None = None) -> dict:
    """What state_summary must find for events holding every key of ``keys`` once with ``values`` (numpy int64)."""
    k1, k2 = keys % 1000003, keys % 999983
    out: dict = {
        "rows": len(keys),
        "sum_count": len(keys),
        "min_count": 1 if len(keys) else None,
        "max_count": 1 if len(keys) else None,
        "sum_sum": int(values.sum()),
        "sum_key": int(k1.sum()),
        "key_x_sum": int((k1 * values).sum()),
        "key_x_key": int(((k2 * k1) % 1000033).sum()),
    }
    if sample_keys:
        index = np.isin(keys, np.asarray(sample_keys, dtype=np.int64))
        out["sample"] = {int(k): (1, int(v)) for k, v in zip(keys[index], values[index])}
    return out


def compare_summary(got: dict, expected: dict) -> list[str]:
    """The checksums (and sampled keys) where ``got`` differs from ``expected``."""
    problems = [f"{name}: {got.get(name)} != {want}" for name, want in expected.items()
                if name != "sample" and got.get(name) != want]
    if "sample" in expected:
        wrong = {k: (got.get("sample", {}).get(k), v) for k, v in expected["sample"].items()
                 if got.get("sample", {}).get(k) != v}
        if wrong:
            problems.append(f"{len(wrong)} of {len(expected['sample'])} sampled keys differ, e.g. "
                            f"{dict(list(wrong.items())[:3])} (got, want)")
    return problems


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=5_000_000)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--files", type=int, default=10, help="event files = micro-batches (1 file per trigger)")
    ap.add_argument("--partitions", type=int, default=4, help="spark.sql.shuffle.partitions = state partitions")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first, on the same JVM")
    ap.add_argument("--data-dir", default=None, help="event log directory (default: a fresh temporary one)")
    ap.add_argument("--work-dir", default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the last run's checkpoint (printed)")
    args = ap.parse_args(argv)

    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="tws-baseline-"))
    data = pathlib.Path(args.data_dir) if args.data_dir else work / "events"
    t = time.perf_counter()
    generate_events(data, args.events, args.keys, args.files)
    expected = reference_state(data)
    print(f"events: {args.events:,} over {args.keys:,} keys in {args.files} files at {data} "
          f"({time.perf_counter() - t:.1f}s incl. pandas reference)", flush=True)

    spark = build_session()
    results = []
    failures = 0
    try:
        for i in range(args.warmup + args.runs):
            ck = work / f"checkpoint-{i}"
            shutil.rmtree(ck, ignore_errors=True)
            r = run_tws(spark, str(data), str(ck), args.partitions)
            problems = compare_state(r["state"], expected)
            failures += bool(problems)
            kind = "warmup" if i < args.warmup else "run"
            print(f"{kind} {i}: {r['seconds']:.2f}s  {r['events_per_s']:,.0f} events/s  {r['batches']} batches  "
                  f"state {'OK' if not problems else 'MISMATCH: ' + '; '.join(problems)}", flush=True)
            if i >= args.warmup:
                results.append(r)
            if not (args.keep and i == args.warmup + args.runs - 1):
                shutil.rmtree(ck, ignore_errors=True)
            else:
                print(f"kept checkpoint: {ck}")
    finally:
        spark.stop()
    secs = statistics.median(r["seconds"] for r in results)
    print(f"\n== Spark transformWithStateInPandas (ValueState, timeMode=None, RocksDB, "
          f"{args.partitions} shuffle partitions, local[2])")
    runs = ", ".join(f"{r['seconds']:.2f}" for r in results)
    print(f"median of {len(results)}: {secs:.2f}s  {args.events / secs:,.0f} events/s  (runs: {runs})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
