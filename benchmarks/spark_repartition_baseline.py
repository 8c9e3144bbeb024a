"""Spark's offline state repartition, the baseline for the cost of a keygroups rescale (restore at p'=8 of p=4 state).

Spark 4.2+ ships ``spark._streamingCheckpointManager.repartition(checkpoint, n)`` (experimental, Spark Classic only):
with the query stopped, it reads ALL the state of the last committed batch through the state data source, shuffles
it to ``n`` partitions, rewrites every partition's RocksDB state and commits a new batch ``N+1`` that reads no input
(its offset log entry repeats batch N's source offsets with ``spark.sql.shuffle.partitions`` = n, which the resumed
query then uses). Only the RocksDB provider is supported: on the HDFS-backed provider it fails with
``STATE_REPARTITION_INVALID_CHECKPOINT.UNSUPPORTED_PROVIDER`` (this script shows it). Here it runs on the checkpoint of
``spark_tws_baseline`` (transformWithStateInPandas, one ValueState, RocksDB provider) written with 4 partitions.

    python benchmarks/spark_repartition_baseline.py --events 200000 --keys 10000 --files 4    # development size
    python benchmarks/spark_repartition_baseline.py                                            # 5M events, 100k keys
    python benchmarks/spark_repartition_baseline.py --checkpoint CK --data-dir EVENTS         # reuse a kept run of
                                                                    # spark_tws_baseline.py --keep (repartitions only)

Without ``--checkpoint`` the script writes the p=4 checkpoint over all files but the last, times ``--runs``
repartitions (each on a fresh copy), checks the state after each against pandas, resumes the repartitioned query on
the last file and checks again. It also shows what Spark does when only ``spark.sql.shuffle.partitions`` changes
between runs of a checkpoint: nothing — the query keeps the partition count recorded in the checkpoint's offset
log, logging at WARN "Updating the value of conf 'spark.sql.streaming.internal.stateStore.partitions' in current
session from '8' to '4'." (``--skip-shuffle-change`` leaves that out).

``run_spark_repartition(spark, checkpoint_dir, new_partitions)`` is the entry point for a side-by-side benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _events import compare_state, copy_files, event_files, generate_events, reference_state  # noqa: E402
from spark_tws_baseline import build_session, read_state, run_tws, start_query  # noqa: E402

from pyspark.sql import SparkSession  # noqa: E402


def _stage_ids(spark: SparkSession) -> set[int]:
    store = spark.sparkContext._jsc.sc().statusStore()
    seq = store.stageList(None, False, False, getattr(store, "stageList$default$4")(), None)
    return {seq.apply(i).stageId() for i in range(seq.size())}


def _stage_metrics(spark: SparkSession, skip: set[int]) -> dict:
    """Summed input/shuffle bytes of the stages not in ``skip`` (Spark's own task metrics, from the status store)."""
    store = spark.sparkContext._jsc.sc().statusStore()
    seq = store.stageList(None, False, False, getattr(store, "stageList$default$4")(), None)
    totals = {"input_bytes": 0, "input_records": 0, "shuffle_write_bytes": 0, "shuffle_read_bytes": 0, "tasks": 0}
    for i in range(seq.size()):
        s = seq.apply(i)
        if s.stageId() in skip:
            continue
        totals["input_bytes"] += s.inputBytes()
        totals["input_records"] += s.inputRecords()
        totals["shuffle_write_bytes"] += s.shuffleWriteBytes()
        totals["shuffle_read_bytes"] += s.shuffleReadBytes()
        totals["tasks"] += s.numTasks()
    return totals


def _dir_bytes(path: pathlib.Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def state_partitions(checkpoint_dir: str | os.PathLike, operator: int = 0) -> int:
    """Number of state partition directories of one stateful operator in a checkpoint."""
    d = pathlib.Path(checkpoint_dir) / "state" / str(operator)
    return sum(1 for p in d.iterdir() if p.is_dir() and p.name.isdigit())


def last_batch_shuffle_partitions(checkpoint_dir: str | os.PathLike) -> tuple[int, int]:
    """(batch id, spark.sql.shuffle.partitions) recorded in the offset log of the checkpoint's last batch."""
    offsets = pathlib.Path(checkpoint_dir) / "offsets"
    last = max(int(p.name) for p in offsets.iterdir() if p.name.isdigit())
    lines = (offsets / str(last)).read_text().splitlines()
    meta = json.loads(lines[1])  # line 0 is the log version, line 1 the batch metadata with the session conf
    return last, int(meta["conf"]["spark.sql.shuffle.partitions"])


def run_spark_repartition(spark: SparkSession, checkpoint_dir: str, new_partitions: int) -> dict:
    """Repartition the (stopped) query's state in ``checkpoint_dir`` to ``new_partitions``, offline, once.

    Returns seconds (wall time of the call), bytes_read (task input bytes Spark reports for the job: the state read
    through the state data source), shuffle_bytes, state_bytes_before/after (all files under state/),
    partitions_before/after (state partition directories).
    """
    ck = pathlib.Path(checkpoint_dir)
    before = {"state_bytes_before": _dir_bytes(ck / "state"), "partitions_before": state_partitions(ck)}
    skip = _stage_ids(spark)
    start = time.perf_counter()
    spark._streamingCheckpointManager.repartition(str(ck), int(new_partitions))
    seconds = time.perf_counter() - start
    m = _stage_metrics(spark, skip)
    return {
        "seconds": seconds,
        "bytes_read": m["input_bytes"],
        "records_read": m["input_records"],
        "shuffle_bytes": m["shuffle_write_bytes"],
        "tasks": m["tasks"],
        **before,
        "state_bytes_after": _dir_bytes(ck / "state"),
        "partitions_after": state_partitions(ck),
    }


def _run_until_done(spark: SparkSession, source: pathlib.Path, ck: pathlib.Path) -> dict:
    """Resume the TWS query on ``ck`` over ``source`` (availableNow); returns the stateful operator's last progress."""
    q = start_query(spark, str(source), str(ck))
    q.awaitTermination()
    if q.exception() is not None:
        raise RuntimeError(f"resumed query failed: {q.exception()}")
    progress = [p for p in q.recentProgress if p["numInputRows"] > 0]
    if not progress:
        raise RuntimeError("the resumed query processed no input")
    op = progress[-1]["stateOperators"][0]
    return {
        "numShufflePartitions": op.get("numShufflePartitions"),
        "numStateStoreInstances": op.get("numStateStoreInstances"),
        "rows": sum(p["numInputRows"] for p in progress),
    }


def shuffle_change_experiment(spark: SparkSession, base: pathlib.Path, source: pathlib.Path, work: pathlib.Path,
                              data: pathlib.Path, new_partitions: int) -> dict:
    """Resume a copy of the p=4 checkpoint on the grown ``source`` with only the session conf set to new_partitions.

    The copy must read the same source directory: the file source's log records absolute paths.
    """
    ck = work / "shuffle-change-ck"
    shutil.rmtree(ck, ignore_errors=True)
    shutil.copytree(base, ck)
    spark.conf.set("spark.sql.shuffle.partitions", str(new_partitions))
    # At WARN, Spark logs the conf it takes from the checkpoint: "Updating the value of conf
    # 'spark.sql.shuffle.partitions' in current session from '8' to '4'."
    spark.sparkContext.setLogLevel("WARN")
    try:
        op = _run_until_done(spark, source, ck)
    finally:
        spark.sparkContext.setLogLevel("ERROR")
    batch, recorded = last_batch_shuffle_partitions(ck)
    state = read_state(spark, str(ck))
    problems = compare_state(state, reference_state(data))
    return {
        "session_conf": new_partitions,
        "progress": op,
        "offset_log": {"batch": batch, "spark.sql.shuffle.partitions": recorded},
        "state_partition_dirs": state_partitions(ck),
        "state": "OK" if not problems else "; ".join(problems),
    }


HDFS_PROVIDER = "org.apache.spark.sql.execution.streaming.state.HDFSBackedStateStoreProvider"


def provider_experiment(spark: SparkSession, source: pathlib.Path, work: pathlib.Path, old_partitions: int,
                        new_partitions: int) -> dict:
    """Try the offline repartition on a plain streaming aggregation kept by the default (HDFS-backed) provider."""
    ck = work / "hdfs-provider-ck"
    shutil.rmtree(ck, ignore_errors=True)
    saved = spark.conf.get("spark.sql.streaming.stateStore.providerClass") or HDFS_PROVIDER
    spark.conf.set("spark.sql.streaming.stateStore.providerClass", HDFS_PROVIDER)
    spark.conf.set("spark.sql.shuffle.partitions", str(old_partitions))
    try:
        agg = (
            spark.readStream.schema("key long, value long, ts long").parquet(str(source))
            .groupBy("key").agg({"value": "sum", "*": "count"})
        )
        q = (agg.writeStream.format("noop").outputMode("update").option("checkpointLocation", str(ck))
             .trigger(availableNow=True).start())
        q.awaitTermination()
    finally:
        spark.conf.set("spark.sql.streaming.stateStore.providerClass", saved)
    try:
        spark._streamingCheckpointManager.repartition(str(ck), int(new_partitions))
    except Exception as e:  # the point is to report what Spark says
        text = str(e)
        m = re.search(r"\[([A-Z_.]+)\][^\n]*", text)
        return {"provider": HDFS_PROVIDER, "repartition": "failed",
                "error": m.group(1) if m else type(e).__name__, "message": m.group(0) if m else text[:500]}
    return {"provider": HDFS_PROVIDER, "repartition": "ok", "partitions_after": state_partitions(ck)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=5_000_000)
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--files", type=int, default=10)
    ap.add_argument("--from-partitions", type=int, default=4)
    ap.add_argument("--to-partitions", type=int, default=8)
    ap.add_argument("--runs", type=int, default=3, help="repartitions timed, each on a fresh copy of the checkpoint")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--skip-shuffle-change", action="store_true")
    ap.add_argument("--skip-provider-check", action="store_true",
                    help="do not try the repartition on a streaming aggregation with the HDFS-backed provider")
    ap.add_argument("--checkpoint", default=None,
                    help="reuse a stopped checkpoint of spark_tws_baseline.py (--keep) over all of --data-dir "
                         "instead of writing one; only the repartitions are run (no resume, no shuffle-change run)")
    args = ap.parse_args(argv)
    if args.files < 2:
        ap.error("--files must be >= 2 (the last file is held back to resume the query after the repartition)")

    work = pathlib.Path(args.work_dir or tempfile.mkdtemp(prefix="spark-repartition-"))
    data = pathlib.Path(args.data_dir) if args.data_dir else work / "events"
    if args.checkpoint:
        if not args.data_dir:
            ap.error("--checkpoint needs the --data-dir its query read")
        files = event_files(data)
        head = files  # the reused checkpoint covers the whole log
        expected_head = expected_all = reference_state(data)
    else:
        files = generate_events(data, args.events, args.keys, args.files)
        head = files[:-1]  # the checkpoint covers all files but the last; the last is the input after the rescale
        expected_head = reference_state(data, head)
        expected_all = reference_state(data)
    failures = 0

    results: list[dict] = []
    spark = build_session()
    try:
        source, base = work / "source", work / "base-checkpoint"
        if args.checkpoint:
            base = pathlib.Path(args.checkpoint)
            print(f"reusing checkpoint {base}: {state_partitions(base)} state partitions", flush=True)
        else:
            for d in (source, base):
                shutil.rmtree(d, ignore_errors=True)
            copy_files(head, source)
            r = run_tws(spark, str(source), str(base), args.from_partitions)
            problems = compare_state(r["state"], expected_head)
            failures += bool(problems)
            print(f"checkpoint at p={args.from_partitions}: {r['events']:,} events in {r['batches']} batches, "
                  f"{r['seconds']:.1f}s ({r['events_per_s']:,.0f} events/s), "
                  f"state {'OK' if not problems else problems}", flush=True)

        for i in range(args.runs):
            ck = work / f"repartition-{i}"
            shutil.rmtree(ck, ignore_errors=True)
            shutil.copytree(base, ck)
            res = run_spark_repartition(spark, str(ck), args.to_partitions)
            after = read_state(spark, str(ck))
            problems = compare_state(after, expected_head)
            failures += bool(problems) or res["partitions_after"] != args.to_partitions
            print(f"repartition {i}: {res['seconds']:.2f}s  read {res['bytes_read']:,} B ({res['records_read']:,} "
                  f"rows)  shuffled {res['shuffle_bytes']:,} B  state dir {res['state_bytes_before']:,} -> "
                  f"{res['state_bytes_after']:,} B  partitions {res['partitions_before']} -> "
                  f"{res['partitions_after']}  state {'OK' if not problems else problems}", flush=True)
            results.append(res)

        if args.checkpoint:
            return 1 if failures else 0
        # The repartitioned checkpoint must resume: feed it the held-back file, the session conf left at "from".
        ck = work / f"repartition-{args.runs - 1}"
        copy_files(files[-1:], source)
        spark.conf.set("spark.sql.shuffle.partitions", str(args.from_partitions))
        op = _run_until_done(spark, source, ck)
        problems = compare_state(read_state(spark, str(ck)), expected_all)
        failures += bool(problems)
        print(f"resumed after repartition: {op}, state {'OK' if not problems else problems}", flush=True)

        if not args.skip_shuffle_change:
            exp = shuffle_change_experiment(spark, base, source, work, data, args.to_partitions)
            failures += exp["state"] != "OK"
            print(f"only spark.sql.shuffle.partitions changed to {args.to_partitions}: {json.dumps(exp)}", flush=True)
        if not args.skip_provider_check:
            print(f"repartition of a streaming aggregation on the HDFS-backed provider: "
                  f"{json.dumps(provider_experiment(spark, source, work, args.from_partitions, args.to_partitions))}",
                  flush=True)
    finally:
        spark.stop()
        if results:
            secs = statistics.median(r["seconds"] for r in results)
            print(f"\n== Spark offline state repartition ({results[-1]['partitions_before']} -> "
                  f"{args.to_partitions} partitions, transformWithStateInPandas ValueState, RocksDB, "
                  f"{results[-1]['records_read']:,} keys, local[2])")
            print(f"median of {len(results)}: {secs:.2f}s  bytes read {results[-1]['bytes_read']:,}  "
                  f"(runs: {', '.join(format(r['seconds'], '.2f') for r in results)})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
