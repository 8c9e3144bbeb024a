"""Timers and event time (issue 13): what a timer costs, and a session-timeout job against Spark's own timers.

1. Micro (no Spark, one subtask in this process = one core), per backend, through the runtime the Spark runner
   uses (begin_batch / run_keyed_subtask / commit_batch), one timer per key on ``--keys`` keys (heap, default 1M)
   and ``--rocksdb-keys`` (default: as many):
     register  a batch of one record per key whose process_element registers one event-time timer (watermark stays
               below every timer), then
     fire      a batch with no records whose watermark passes every timer: each fires once (on_timer does nothing);
               "warm": the backend and its timer queues kept from the previous batch, as in a reused Spark worker;
               "cold": both (and RocksDB's local database) dropped first, as on a new worker: the state is restored
               from the checkpoint and the queues are rebuilt by reading every timer from it.
   Baseline, the same batches with plain ValueState instead of timers: one ``update`` per key (register), then a
   batch of the same records whose process_element reads and clears the value (fire). Printed: registrations/s
   and firings/s per core from the subtask's own timing of the state work ("phase": the process_element calls;
   restore + building the queues + the firing loop) and per whole batch (input sort, output and snapshot included),
   with the phase rate's ratio to the baseline's.

2. Session timeout, keygroups ``KeyedJob`` against Spark's ``transformWithStateInPandas(timeMode="EventTime")`` on
   the same events, same Spark session (``local[2]``), same parallelism (Spark: spark.sql.shuffle.partitions):
   events (user, event time) arrive in ``--batches`` micro-batches (one Parquet file each); per user a ValueState
   (last activity, events) and one event-time timer at last activity + ``--gap``, moved on each batch of the user's
   events; when it fires the function emits (user, session_end, count). An event at or after last activity + gap
   closes the user's session itself (emits it) and starts a new one, so what is emitted does not depend on when a
   watermark lets a timer fire.

   Watermarks differ: keygroups' batch fires the timers up to the watermark it *ends* with (from its own largest
   event time, minus ``--delay`` and 1 ms, Flink's rule); Spark fires, in batch N, the timers up to the watermark
   that batches before N reached (one batch behind). Batch b's event times lie in [b, b+1) * ``--window`` and are
   shuffled within the file, so no event is late for either, and per user they only increase. After the real
   batches two files with one event each of two sentinel users (far later) push both watermarks past every real
   session (Spark needs the second file to apply what the first one showed). Both outputs, sentinel users left
   out, must equal the reference (numpy/pandas, no runtime: a user's consecutive events less than gap apart form
   a session), as sets and with no session emitted twice, before any figure is printed. events/s = all events
   (sentinels included) / wall time of the whole run (keygroups: every run_batch call, one per file, each with its
   Spark aggregation for the watermark; Spark: query start to termination, availableNow, RocksDB state, a Parquet
   sink). Target: keygroups >= 3x the events/s of transformWithStateInPandas.

   Defaults: 300k events of 30k users in 10 batches of 10 min, gap 15 min, out-of-orderness 1 min, parallelism 2;
   first an untimed warm-up round of every runner over a small data set of the same shape (JVM, Python workers).

    python benchmarks/bench_timers.py                                   # both parts, default sizes, 3 runs
    python benchmarks/bench_timers.py --part micro --keys 10000000 --runs 1
    python benchmarks/bench_timers.py --part sessions --events 2000000 --users 200000 --backends heap

Medians of ``--runs`` runs, the candidates interleaved within each run; the load average of the (shared) machine is
printed beside each figure. Speed is never asserted in tests.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import pathlib
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from keygroups.checkpoint import CheckpointStorage
from keygroups.runtime import KeyedProcessFunction, WatermarkStrategy, begin_batch, commit_batch
from keygroups.runtime.subtask import run_keyed_subtask
from keygroups.runtime.subtask_state import HEAP_BACKENDS
from keygroups.serializers import Int64Serializer, TupleSerializer
from keygroups.state import ValueStateDescriptor
from keygroups.state.timers import TIMER_QUEUES

# Spark's side (spark_tws_baseline: the session, the RocksDB provider) is imported only by the sessions part.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

MAX_PARALLELISM = 128
BACKENDS = ("heap", "rocksdb")
TS_START_MS = 1_767_225_600_000  # 2026-01-01T00:00:00Z
MINUTE_MS = 60_000


def load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


# ==== 1. micro: timers through the runtime, no Spark =================================================================

MICRO_INPUT = pa.schema([("key", pa.int64()), ("t", pa.int64())])
MICRO_OUTPUT = pa.schema([("key", pa.int64())])
VALUE = ValueStateDescriptor("value", Int64Serializer())


class RegisterTimer(KeyedProcessFunction):
    """One event-time timer per record, at the record's ``t``; firing does nothing (the timer machinery alone)."""

    def process_element(self, record, context):
        context.timer_service.register_event_time_timer(record["t"])

    def on_timer(self, timestamp, context):
        return None


class WriteValue(KeyedProcessFunction):
    """The baseline of a registration: one ValueState write per record."""

    def open(self, context):
        self.value = context.get_state(VALUE)

    def process_element(self, record, context):
        self.value.update(record["t"])


class ClearValue(KeyedProcessFunction):
    """The baseline of a firing: visit the key (one record each), read its value and clear it."""

    def open(self, context):
        self.value = context.get_state(VALUE)

    def process_element(self, record, context):
        if self.value.value() is not None:
            self.value.clear()


def _micro_batch(location: str, local_dir: str, backend: str, function: KeyedProcessFunction,
                 table: pa.Table | None, watermark: int | None) -> tuple[dict[str, Any], float]:
    """One batch of one subtask (parallelism 1): plan, run, commit; returns its report and wall seconds."""
    start = time.perf_counter()
    plan = begin_batch(CheckpointStorage(location), job_name="timers", max_parallelism=MAX_PARALLELISM,
                       parallelism=1)
    spec = plan.keyed_task(key_columns=("key",), function=pickle.dumps(function), input_schema=MICRO_INPUT,
                           output_schema=MICRO_OUTPUT, backend=backend, local_dir=local_dir, watermark=watermark)
    report = run_keyed_subtask(spec, 0, table.to_batches() if table is not None else [])
    commit_batch(plan, [report], watermark=watermark)
    return report.to_json(), time.perf_counter() - start


def _forget_warm_state() -> None:
    """What a new Python worker process starts with: no kept heap backend, no kept timer queues."""
    HEAP_BACKENDS.clear()
    TIMER_QUEUES.clear()


def micro_once(kind: str, backend: str, table: pa.Table, work: pathlib.Path) -> dict[str, float]:
    """kind "warm", "cold" (timers) or "value" (baseline): the register batch, then the fire batch; checked."""
    n = table.num_rows
    location, local_dir = str(work / f"{kind}-{backend}"), str(work / f"local-{kind}-{backend}")
    last = int(np.max(table.column("t").to_numpy()))
    _forget_warm_state()
    gc.collect()
    gc.disable()  # as _util.measure: the cyclic GC's passes over a million fresh objects are not the candidates'
    try:
        if kind == "value":
            r1, s1 = _micro_batch(location, local_dir, backend, WriteValue(), table, None)
            r2, s2 = _micro_batch(location, local_dir, backend, ClearValue(), table, last)
            if r2["records_in"] != n:
                raise SystemExit(f"value baseline ({backend}): the clearing batch got {r2['records_in']} of {n} "
                                 "records")
        else:
            r1, s1 = _micro_batch(location, local_dir, backend, RegisterTimer(), table, None)
            if kind == "cold":  # a new worker on another machine: no kept backend, queues or local database
                _forget_warm_state()
                shutil.rmtree(local_dir, ignore_errors=True)
            r2, s2 = _micro_batch(location, local_dir, backend, RegisterTimer(), None, last)
            registered = r1["timers"]["event-time"]["registered"]
            fired = r2["timers"]["event-time"]
            rebuilt_expected = kind == "cold"
            if registered != n or fired["fired"] != n or fired["queued"] != 0 or fired["rebuilt"] != rebuilt_expected:
                raise SystemExit(f"timers ({kind}, {backend}): registered {registered}, fired {fired['fired']}, "
                                 f"left queued {fired['queued']}, queues rebuilt {fired['rebuilt']}; expected "
                                 f"{n}, {n}, 0, {rebuilt_expected}")
    finally:
        gc.enable()
        _forget_warm_state()
        shutil.rmtree(location, ignore_errors=True)
        shutil.rmtree(local_dir, ignore_errors=True)
    # The state work of each batch as the subtask timed it: restore (a kept backend: ~0; cold: the restore, and
    # building the timer queues happens in "process"), the function's records, the firing loop. Not the input's
    # sorting, the output or the snapshot: those are in the batch time.
    fire = r2["seconds"]["restore"] + r2["seconds"]["process"] + r2["seconds"]["timers"]
    return {"register_phase": r1["seconds"]["process"], "register_batch": s1, "fire_phase": fire,
            "fire_batch": s2, "fire_snapshot": r2["seconds"]["snapshot"]}


def micro_table(n_keys: int, seed: int = 13) -> pa.Table:
    """One record per key 0..n-1 (shuffled), ``t`` an event time within one hour of TS_START_MS."""
    rng = np.random.default_rng(seed)
    keys = rng.permutation(n_keys).astype(np.int64)
    t = TS_START_MS + rng.integers(0, 3_600_000, n_keys, dtype=np.int64)
    return pa.table({"key": keys, "t": t}, schema=MICRO_INPUT)


def run_micro(args: argparse.Namespace, work: pathlib.Path) -> None:
    sizes = {"heap": args.keys, "rocksdb": args.rocksdb_keys or args.keys}
    tables = {b: micro_table(sizes[b]) for b in args.backends}
    kinds = ("warm", "cold", "value")
    times: dict[tuple[str, str], list[dict[str, float]]] = {(b, k): [] for b in args.backends for k in kinds}
    loads: list[float] = []
    for run in range(args.runs):
        for backend in args.backends:
            for kind in kinds:
                r = micro_once(kind, backend, tables[backend], work)
                times[backend, kind].append(r)
                loads.append(os.getloadavg()[0])
                print(f"run {run + 1} {backend:<8}{kind:<6} register: batch {r['register_batch']:6.2f} s "
                      f"(process {r['register_phase']:6.2f} s)  fire: batch {r['fire_batch']:6.2f} s "
                      f"(phase {r['fire_phase']:6.2f} s, snapshot {r['fire_snapshot']:6.2f} s)  {load()}", flush=True)

    def med(backend: str, kind: str, what: str) -> float:
        return statistics.median(r[what] for r in times[backend, kind])

    print(f"\n== timers per second per core: one timer per key, parallelism 1 in one process, medians of "
          f"{args.runs} runs (load average {min(loads):.1f}-{max(loads):.1f} on {os.cpu_count()} cores)")
    print("   phase = the state work as the subtask timed it (register: the process_element calls; fire: restore + "
          "building the queues + the firing loop);\n   batch = plan + run + commit (input sort, output and "
          "snapshot included); ratio = phase /s against the baseline's")
    print(f"{'backend':<9}{'keys':>11}  {'operation':<44}{'phase /s':>13}{'batch /s':>13}{'vs base':>10}")
    rows = (("register event-time timer", "warm", "register"),
            ("  baseline: ValueState update", "value", "register"),
            ("fire (warm: queues kept from last batch)", "warm", "fire"),
            ("fire (cold: state restored, queues rebuilt)", "cold", "fire"),
            ("  baseline: ValueState read + clear", "value", "fire"))
    for backend in args.backends:
        n = sizes[backend]
        for label, kind, what in rows:
            phase = n / med(backend, kind, f"{what}_phase")
            batch = n / med(backend, kind, f"{what}_batch")
            base = n / med(backend, "value", f"{what}_phase")
            ratio = "" if kind == "value" else f"{phase / base:>9.2f}x"
            print(f"{backend:<9}{n:>11,}  {label:<44}{phase:>13,.0f}{batch:>13,.0f}{ratio}")


# ==== 2. session timeout: keygroups KeyedJob vs transformWithStateInPandas (EventTime) ===============================

SESSION_OUTPUT = pa.schema([("user", pa.int64()), ("session_end", pa.int64()), ("count", pa.int64())])
SESSION_OUTPUT_DDL = "user long, session_end long, count long"
SESSION_INPUT_DDL = "user long, ts timestamp, t_ms long"
SESSION = ValueStateDescriptor("session", TupleSerializer(Int64Serializer(), Int64Serializer()))
SENTINEL_USERS = (-1, -2)
MANIFEST = "_sessions.json"


def advance_session(last: int | None, count: int, times: list[int], gap_ms: int
                    ) -> tuple[int, int, list[tuple[int, int]]]:
    """A user's session after its next events (``times`` sorted, none before ``last``): (last activity, events,
    the sessions these events closed as (session_end, count)). The same logic in both runners."""
    closed = []
    for t in times:
        if last is not None and t >= last + gap_ms:
            closed.append((last + gap_ms, count))
            last = None
        if last is None:
            last, count = t, 1
        else:
            last, count = t, count + 1
    assert last is not None
    return last, count, closed


class SessionTimeout(KeyedProcessFunction):
    """keygroups: per user (last activity, events) and an event-time timer at last activity + gap."""

    def __init__(self, gap_ms: int) -> None:
        self.gap_ms = gap_ms

    def open(self, context):
        self.session = context.get_state(SESSION)

    def process_key_batch(self, key, records, context):
        gap = self.gap_ms
        current = self.session.value()
        last, count = current if current is not None else (None, 0)
        times = np.sort(records.column("t_ms").to_numpy()).tolist()
        new_last, new_count, closed = advance_session(last, count, times, gap)
        if new_last != last:
            timers = context.timer_service
            if last is not None:
                timers.delete_event_time_timer(last + gap)
            timers.register_event_time_timer(new_last + gap)
        self.session.update((new_last, new_count))
        return [(key, end, n) for end, n in closed]

    def on_timer(self, timestamp, context):
        current = self.session.value()
        if current is not None and current[0] + self.gap_ms == timestamp:
            self.session.clear()
            return [(context.current_key, timestamp, current[1])]
        return None


def _tws_processor(gap_ms: int) -> Any:
    """Spark: the same logic as a StatefulProcessor (ValueState + one event-time timer per user)."""
    from pyspark.sql.streaming import StatefulProcessor

    class SessionTimeoutProcessor(StatefulProcessor):
        def init(self, handle):
            self.handle = handle
            self.session = handle.getValueState("session", "last long, count long")

        def handleInputRows(self, key, rows, timerValues) -> Iterator[pd.DataFrame]:
            current = self.session.get()
            last, count = (int(current[0]), int(current[1])) if current is not None else (None, 0)
            times = np.sort(np.concatenate([pdf["t_ms"].to_numpy() for pdf in rows])).tolist()
            new_last, new_count, closed = advance_session(last, count, times, gap_ms)
            if new_last != last:
                if last is not None:
                    self.handle.deleteTimer(last + gap_ms)
                self.handle.registerTimer(new_last + gap_ms)
            self.session.update((new_last, new_count))
            if closed:
                yield pd.DataFrame({"user": [int(key[0])] * len(closed), "session_end": [e for e, _ in closed],
                                    "count": [c for _, c in closed]})

        def handleExpiredTimer(self, key, timerValues, expiredTimerInfo) -> Iterator[pd.DataFrame]:
            timestamp = expiredTimerInfo.getExpiryTimeInMs()
            current = self.session.get()
            if current is not None and int(current[0]) + gap_ms == timestamp:
                self.session.clear()
                yield pd.DataFrame({"user": [int(key[0])], "session_end": [timestamp], "count": [int(current[1])]})

        def close(self):
            pass

    return SessionTimeoutProcessor()


def generate_sessions(directory: pathlib.Path, args: argparse.Namespace) -> list[str]:
    """The event files in order (real batches, then the two sentinel files); reused when the parameters match.
    Modification times increase file by file: Spark's file source takes files in that order."""
    params = {"events": args.events, "users": args.users, "batches": args.batches, "window_ms": args.window_ms,
              "gap_ms": args.gap_ms, "delay_ms": args.delay_ms, "seed": args.seed, "format": 1}
    names = [f"part-{i:05d}.parquet" for i in range(args.batches + len(SENTINEL_USERS))]
    manifest = directory / MANIFEST
    if manifest.exists() and json.loads(manifest.read_text()) == params:
        return [str(directory / n) for n in names]
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    base, extra = divmod(args.events, args.batches)
    tables = []
    for b in range(args.batches):
        size = base + (1 if b < extra else 0)
        rng = np.random.default_rng([args.seed, b])
        users = rng.integers(0, args.users, size, dtype=np.int64)
        t = TS_START_MS + b * args.window_ms + rng.integers(0, args.window_ms, size, dtype=np.int64)
        tables.append((users, t))
    end = TS_START_MS + args.batches * args.window_ms
    # Far enough that either watermark passes every real timer (last activity + gap < end + gap).
    sentinel_t = end + args.gap_ms + args.delay_ms + 10 * MINUTE_MS
    for i, user in enumerate(SENTINEL_USERS):
        tables.append((np.array([user], np.int64), np.array([sentinel_t + i * MINUTE_MS], np.int64)))
    now = time.time() - len(names)
    for i, ((users, t), name) in enumerate(zip(tables, names)):
        table = pa.table({"user": users, "ts": pa.array(t, pa.timestamp("ms", "UTC")), "t_ms": t})
        tmp = directory / f".{name}.tmp"
        pq.write_table(table, tmp)
        os.replace(tmp, directory / name)
        os.utime(directory / name, (now + i, now + i))
    manifest.write_text(json.dumps(params))
    return [str(directory / n) for n in names]


def reference_sessions(files: list[str], gap_ms: int) -> set[tuple[int, int, int]]:
    """Every session of the real users, by pandas: a user's events sorted by time, a new session wherever the
    next event is gap or more after the previous one; (user, last event + gap, events)."""
    df = pq.read_table(files, columns=["user", "t_ms"]).to_pandas()
    df = df[~df["user"].isin(SENTINEL_USERS)].sort_values(["user", "t_ms"], kind="stable")
    user, t = df["user"].to_numpy(), df["t_ms"].to_numpy()
    starts = np.ones(len(df), dtype=bool)
    starts[1:] = (user[1:] != user[:-1]) | (t[1:] - t[:-1] >= gap_ms)
    session = np.cumsum(starts)
    agg = pd.DataFrame({"session": session, "user": user, "t": t}).groupby("session").agg(
        user=("user", "first"), last=("t", "max"), count=("t", "size"))
    return set(zip(agg["user"].tolist(), (agg["last"] + gap_ms).tolist(), agg["count"].tolist()))


def as_sessions(pdf: pd.DataFrame) -> tuple[set[tuple[int, int, int]], int]:
    """(set of real users' sessions, rows emitted for them: a row emitted twice shows as rows > len(set))."""
    real = pdf[~pdf["user"].isin(SENTINEL_USERS)]
    rows = list(zip(real["user"].astype("int64").tolist(), real["session_end"].astype("int64").tolist(),
                    real["count"].astype("int64").tolist()))
    return set(rows), len(rows)


def check_sessions(who: str, got: pd.DataFrame, expected: set[tuple[int, int, int]]) -> None:
    sessions, rows = as_sessions(got)
    problems = []
    if rows != len(sessions):
        problems.append(f"{rows - len(sessions)} sessions emitted more than once")
    missing, extra = expected - sessions, sessions - expected
    if missing:
        problems.append(f"{len(missing)} sessions missing, e.g. {sorted(missing)[:3]}")
    if extra:
        problems.append(f"{len(extra)} unexpected sessions, e.g. {sorted(extra)[:3]}")
    if problems:
        raise SystemExit(f"{who} differs from the reference ({len(expected):,} sessions): {'; '.join(problems)}")


def run_keygroups_sessions(spark: Any, files: list[str], location: str, backend: str,
                           args: argparse.Namespace) -> dict[str, Any]:
    from keygroups.spark import KeyedJob

    job = KeyedJob("sessions", "user", SessionTimeout(args.gap_ms), output_schema=SESSION_OUTPUT,
                   max_parallelism=MAX_PARALLELISM, checkpoint_location=location, backend=backend,
                   timestamp_column="ts", retain=len(files) + 1, local_dir=location + "-local",
                   watermark_strategy=WatermarkStrategy.for_bounded_out_of_orderness(
                       datetime.timedelta(milliseconds=args.delay_ms)))
    results = []
    start = time.perf_counter()
    for path in files:
        results.append(job.run_batch(spark.read.parquet(path), parallelism=args.parallelism))
    seconds = time.perf_counter() - start
    late = sum(r.records_late for r in results)
    if late:
        raise SystemExit(f"keygroups dropped {late} late records; the data has none by construction")
    fired = sum(r.metadata.properties["timers"]["event-time"]["fired"] for r in results)
    outputs = [r.output.toPandas() for r in results]  # not timed, as Spark's sink is read after its run
    return {"seconds": seconds, "events": sum(r.records_in for r in results), "fired": fired,
            "output": pd.concat(outputs, ignore_index=True)}


def run_tws_sessions(spark: Any, events_dir: pathlib.Path, out_dir: pathlib.Path, args: argparse.Namespace
                     ) -> dict[str, Any]:
    from spark_tws_baseline import ROCKSDB_PROVIDER

    spark.conf.set("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
    spark.conf.set("spark.sql.shuffle.partitions", str(args.parallelism))
    start = time.perf_counter()
    events = (spark.readStream.schema(SESSION_INPUT_DDL).option("maxFilesPerTrigger", 1).parquet(str(events_dir))
              .withWatermark("ts", f"{args.delay_ms} milliseconds"))
    sessions = events.groupBy("user").transformWithStateInPandas(
        statefulProcessor=_tws_processor(args.gap_ms), outputStructType=SESSION_OUTPUT_DDL, outputMode="Append",
        timeMode="EventTime")
    query = (sessions.writeStream.format("parquet").option("path", str(out_dir / "sink"))
             .option("checkpointLocation", str(out_dir / "checkpoint")).outputMode("append")
             .trigger(availableNow=True).start())
    query.awaitTermination()
    seconds = time.perf_counter() - start
    if query.exception() is not None:
        raise RuntimeError(f"transformWithStateInPandas query failed: {query.exception()}")
    progress = [p for p in query.recentProgress if p["numInputRows"] > 0]
    output = spark.read.schema(SESSION_OUTPUT_DDL).parquet(str(out_dir / "sink")).toPandas()
    return {"seconds": seconds, "events": sum(p["numInputRows"] for p in progress), "batches": len(progress),
            "all_batches": len(query.recentProgress), "output": output}


def session_round(spark: Any, args: argparse.Namespace, events_dir: pathlib.Path, files: list[str],
                  expected: set[tuple[int, int, int]], n_events: int, work: pathlib.Path, label: str
                  ) -> dict[str, float]:
    """Every runner once over ``files``, outputs checked; seconds by runner ("tws" for Spark)."""
    seconds = {}
    for backend in args.backends:
        location = str(work / f"kg-{backend}-{label}")
        r = run_keygroups_sessions(spark, files, location, backend, args)
        if r["events"] != n_events:
            raise SystemExit(f"keygroups read {r['events']} events, the files hold {n_events}")
        check_sessions(f"keygroups ({backend})", r["output"], expected)
        seconds[backend] = r["seconds"]
        print(f"{label}: keygroups ({backend}) {n_events:,} events in {r['seconds']:.1f} s, {r['fired']:,} timers "
              f"fired, output OK  {load()}", flush=True)
        shutil.rmtree(location, ignore_errors=True)
        shutil.rmtree(location + "-local", ignore_errors=True)
    if not args.skip_spark_baseline:
        out_dir = work / f"tws-{label}"
        r = run_tws_sessions(spark, events_dir, out_dir, args)
        if r["events"] != n_events:
            raise SystemExit(f"transformWithStateInPandas read {r['events']} events, the files hold {n_events}")
        check_sessions("transformWithStateInPandas", r["output"], expected)
        seconds["tws"] = r["seconds"]
        print(f"{label}: transformWithStateInPandas {n_events:,} events in {r['seconds']:.1f} s "
              f"({r['batches']} batches with data, {r['all_batches']} in all), output OK  {load()}", flush=True)
        shutil.rmtree(out_dir, ignore_errors=True)
    return seconds


def run_sessions(args: argparse.Namespace, work: pathlib.Path) -> None:
    events_dir = work / "session-events"
    t = time.perf_counter()
    files = generate_sessions(events_dir, args)
    expected = reference_sessions(files, args.gap_ms)
    n_events = args.events + len(SENTINEL_USERS)
    print(f"\nsessions: {args.events:,} events of {args.users:,} users in {args.batches} batches of "
          f"{args.window_ms / MINUTE_MS:g} min event time, gap {args.gap_ms / MINUTE_MS:g} min, out-of-orderness "
          f"{args.delay_ms / 1000:g} s; reference {len(expected):,} sessions ({time.perf_counter() - t:.1f} s)",
          flush=True)
    # The warm-up: every runner once over a small data set of the same shape (JVM, Python workers, imports).
    small = argparse.Namespace(**{**vars(args), "events": min(args.events, 20_000), "users": min(args.users, 2_000),
                                  "batches": min(args.batches, 2)})
    small_dir = work / "warmup-events"
    small_files = generate_sessions(small_dir, small)

    from spark_tws_baseline import build_session

    spark = build_session(args.master, driver_memory="4g")
    times: list[dict[str, float]] = []
    loads: list[float] = []
    try:
        if args.warmup:
            session_round(spark, small, small_dir, small_files, reference_sessions(small_files, args.gap_ms),
                          small.events + len(SENTINEL_USERS), work, "warm-up")
        for run in range(args.runs):
            times.append(session_round(spark, args, events_dir, files, expected, n_events, work, f"run {run + 1}"))
            loads.append(os.getloadavg()[0])
    finally:
        spark.stop()

    print(f"\n== session timeout: {n_events:,} events, {args.users:,} users, {len(files)} micro-batches, "
          f"parallelism {args.parallelism}, {args.master}, {len(expected):,} sessions checked, medians of {args.runs} "
          f"runs (load average after each run {', '.join(f'{x:.1f}' for x in loads)} on {os.cpu_count()} cores)")
    print(f"{'runner':<56}{'seconds':>10}{'events/s':>12}{'vs TWS':>10}")
    tws = statistics.median(r["tws"] for r in times) if not args.skip_spark_baseline else None
    for backend in args.backends:
        s = statistics.median(r[backend] for r in times)
        ratio = f"{tws / s:>9.1f}x" if tws else ""
        print(f"{f'keygroups KeyedJob ({backend} state)':<56}{s:>10.1f}{n_events / s:>12,.0f}{ratio}")
    if tws:
        print(f"{'Spark transformWithStateInPandas (EventTime, RocksDB)':<56}{tws:>10.1f}{n_events / tws:>12,.0f}"
              f"{1.0:>9.1f}x")
        print("target (issue 13): keygroups >= 3.0x the events/s of transformWithStateInPandas")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("micro", "sessions", "both"), default="both")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--backends", default="heap,rocksdb", help="keygroups state backends, comma-separated")
    parser.add_argument("--keys", type=int, default=1_000_000, help="micro, heap: keys, one timer each")
    parser.add_argument("--rocksdb-keys", type=int, default=None,
                        help="micro, rocksdb: keys, one timer each (default: --keys)")
    parser.add_argument("--events", type=int, default=300_000, help="sessions: events (without the 2 sentinels)")
    parser.add_argument("--users", type=int, default=30_000, help="sessions: users (keys)")
    parser.add_argument("--batches", type=int, default=10, help="sessions: micro-batches (files) of real events")
    parser.add_argument("--window-ms", type=int, default=10 * MINUTE_MS, help="sessions: event time per batch")
    parser.add_argument("--gap-ms", type=int, default=15 * MINUTE_MS, help="sessions: inactivity gap")
    parser.add_argument("--delay-ms", type=int, default=MINUTE_MS, help="sessions: bounded out-of-orderness")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--parallelism", type=int, default=2, help="sessions: subtasks = shuffle partitions")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--no-warmup", dest="warmup", action="store_false",
                        help="sessions: skip the untimed first round over a small data set")
    parser.add_argument("--skip-spark-baseline", action="store_true")
    args = parser.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    unknown = set(args.backends) - set(BACKENDS)
    if unknown or not args.backends:
        parser.error(f"--backends takes a comma-separated subset of {BACKENDS}, got {sorted(unknown) or 'none'}")

    work = pathlib.Path(tempfile.mkdtemp(prefix="kg-bench-timers-"))
    try:
        if args.part in ("micro", "both"):
            run_micro(args, work)
        if args.part in ("sessions", "both"):
            run_sessions(args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
