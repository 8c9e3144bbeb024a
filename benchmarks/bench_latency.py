"""End-to-end latency of a keyed stateful stream on Spark, keygroups beside Spark's own JVM ``transformWithState``
and a stateless ``groupBy``; then small-batch throughput beside PyFlink's thread mode (issue 32 item 6).

    python benchmarks/bench_latency.py                     # 1k and 10k events/s, 150 s per run, rescale every 60 s
    python benchmarks/bench_latency.py --quick             # 1k and 10k events/s, 30 s per run, rescale every 10 s
    python benchmarks/bench_latency.py --rates 10000 --skip groupBy --no-throughput
    python benchmarks/bench_latency.py --rates 1000 --skip keygroups "Spark groupBy" --rescale-to 3 --no-throughput
    python benchmarks/bench_latency.py --rates 1000 --spark-conf spark.python.unix.domain.socket.enabled=true

Part 1, latency. One Spark session (``local[2]``, 2 shuffle partitions). For each rate (``--rates``, events per
second) and each candidate, in turn (the order rotating), a fresh run:

- a generator process writes a Parquet file of ``rate × --file-ms / 1000`` events (columns key long: uniform over
  ``--keys`` keys, value long, ts long) into an empty source directory every ``--file-ms`` ms (written under a
  temporary name, then renamed), for ``--duration`` seconds, and records each file's write time (wall clock just
  after the rename: the moment the file's events are in the source);
- a streaming query reads that directory (Spark's file source, every new file in the next micro-batch) with a
  processing-time trigger of ``--trigger-ms`` and runs the candidate:
  - ``keygroups``: ``KeyedJob`` (:class:`_jobs.RunningValue`: one ValueState per key, read and updated once per
    record, one output row per record; heap, max parallelism 128) through ``job.foreach_batch(parallelism=2)``
    without a sink function: the output files stay in the checkpoint, as TWS's stay in its file sink, neither read
    back. The batch's output is committed when its checkpoint is (``chk-<n>/_metadata``): the time is noted as the
    job's batch returns. (``--also "keygroups output sink"``: through ``foreach_batch(sink)``, timed when the sink
    is called, which is after ``result.output``, a DataFrame over the output files, was built for it: 20-100 ms
    of py4j and file listing per batch on the critical path, and the measure of runs before 2026-11-27);
  - ``keygroups rescale``: the same, its ``foreachBatch`` function calling ``job.run_batch(df, parallelism=p,
    checkpoint_id=batch_id)`` with p switching between 2 and 4 every ``--rescale-every`` seconds (issue 32's
    measure). The job is told both parallelisms (``job.plan_ahead(2, 4)``, as a query that knows what it
    switches between would be), so its batches build the other parallelism's Spark plans beside their own Spark
    job and the first batch at the new parallelism does not plan them then; ``--no-plan-ahead`` leaves it out;
  - ``keygroups rescale 2<->N`` (one per ``--rescale-to N``, run beside ``keygroups rescale``, never instead of
    it): the same, p switching between 2 and N. Why: on a 2-core machine (``local[2]``) the 2<->4 run spends half
    its time with 4 subtasks oversubscribed on 2 cores, against a baseline whose 2 partitions never are; 2<->3
    (3 subtasks on 2 cores) or 2<->1 (fewer subtasks than cores) rescale as often, through the same warm
    takeover and restore of the key groups whose range changed, so the rescale's own cost is seen apart from
    the oversubscription. The baseline and what is measured are the same;
  - ``Spark TWS (JVM)``: ``benchmarks/java/LatencyTws.java`` (a Java ``StatefulProcessor``: the same running sum in
    one ValueState per key, per record, one output row per record; compiled with ``javac`` against pyspark's jars
    into a cache directory and put on the driver's class path; started through py4j): ``groupByKey(key)
    .transformWithState`` (TimeMode.None, RocksDB state store, Spark's only provider for it) into a Parquet file
    sink, whose commit of batch N is the file ``_spark_metadata/N`` (its modification time);
  - ``Spark groupBy``: ``foreachBatch`` of ``df.groupBy("key").agg(count, sum)`` written as Parquet (stateless: the
    floor of a shuffle by key per batch); committed when the write returns: the function notes the time.

  With ``--repeat N`` each candidate runs N times per rate, the order rotating per round (none always first);
  the table adds each candidate's files pooled over its runs, and the target line each round's paired ratio.

  Before all runs, each kind of query is started once, untimed, on one file (``--no-session-warmup`` skips it): the
  session's first queries pay the JVM's warm-up, which would otherwise land on whichever candidate runs first.
  Before the generator starts, one warm-up file goes through the query and its commit is awaited: the query's
  first batch (planning, code generation, the first Python workers) is printed apart as "first batch".
  A file's events are in batch N per the file source's own log (``<checkpoint>/sources/0``); their latency is batch
  N's commit time minus the file's write time (every event of a file has its file's latency; percentiles are over
  events). Files written in the generator's first ``--warmup`` seconds are left out; a file not committed
  within ``--drain`` seconds after the generator stops counts as missing. Printed per run: latency p50, p99 and
  max, batches, events per batch, and the CPU seconds per 1,000 events of the driver's Python, the JVM and Spark's
  Python workers over the run.

Per run (``--tail``, on by default) the slowest 5% of files are traced to their batches: each file's wait for its
batch to start (the batches before it still running) and its batch's run, per phase of Spark's own progress
(``durationMs``: latestOffset, walCommit, getBatch, queryPlanning, addBatch, commitOffsets), for keygroups its
report (wall, Spark's job time, phases, restore modes) and the foreachBatch call's own times, for TWS its state
operator's update and commit times; ``--timeline FILE`` writes every batch's and file's figures as JSON.

Part 2, small-batch throughput: ``--throughput-batches`` files of ``--batch`` events (default 10k, over the same
keys) through ``KeyedJob.run_batch(spark.read.parquet(file), parallelism=2)`` one after another (one untimed first),
events/s = events / the batches' wall time; beside PyFlink thread mode (``python.execution-mode: thread``,
``apache-flink==2.3.0`` in its own virtualenv under ~/.cache/keygroups-bench, made on first use) running the same
keyed job (one ValueState, one output per record, hashmap state, p=2, max p 128) over the same events as one
stream: events / the job's net runtime, and net of its start-up (a run on 1,000 events).

The machine may be shared (load printed); latency is wall clock by nature, so CPU figures stand beside it.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import multiprocessing
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _events import event_files, generate_events  # noqa: E402
from _jobs import VALUE_OUTPUT, RunningValue, ship_by_value  # noqa: E402
from _peers import (  # noqa: E402
    TreeCPU, build_java, load, pyflink_python, spark_classpath, spark_session, spark_setting)

PARALLELISM = 2
RESCALED = 4
MAX_PARALLELISM = 128
ROCKSDB_PROVIDER = "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider"
SCHEMA = pa.schema([("key", pa.int64()), ("value", pa.int64()), ("ts", pa.int64())])
CANDIDATES = ("keygroups", "keygroups rescale", "Spark TWS (JVM)", "Spark groupBy")
#: Run only when named in --also: keygroups through foreach_batch(sink), timed as its sink is called (the output
#: DataFrame is built first).
EXTRA = ("keygroups output sink",)


# ---- the generator (its own process: its timing does not wait for the driver's GIL) ---------------------------------

def generate(directory: str, log: str, rate: int, file_ms: int, duration: float, keys: int, seed: int) -> None:
    """Write a file of ``rate * file_ms / 1000`` events every ``file_ms`` ms for ``duration`` s; ``log`` gets
    ``{"writes": [[name, write time (epoch s), events], ...], "cpu": its own CPU seconds}``."""
    rng = np.random.default_rng(seed)
    per_file = max(1, rate * file_ms // 1000)
    d = pathlib.Path(directory)
    writes = []
    start = time.time()
    k = 0
    while True:
        due = start + k * file_ms / 1000
        if due - start >= duration:
            break
        delay = due - time.time()
        if delay > 0:
            time.sleep(delay)
        now = int(time.time() * 1000)
        table = pa.table({"key": rng.integers(0, keys, per_file, dtype=np.int64),
                          "value": rng.integers(0, 1000, per_file, dtype=np.int64),
                          "ts": np.full(per_file, now, dtype=np.int64)}, schema=SCHEMA)
        name = f"part-{k:06d}.parquet"
        pq.write_table(table, d / f".{name}.tmp")
        os.replace(d / f".{name}.tmp", d / name)
        writes.append([name, time.time(), per_file])
        k += 1
    import resource

    own = sum(getattr(resource.getrusage(w), f) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    pathlib.Path(log).write_text(json.dumps({"writes": writes, "cpu": own}))


# ---- which batch took which file, and when each batch committed ----------------------------------------------------

def batch_of_files(checkpoint: pathlib.Path) -> dict[str, int]:
    """File name -> batch id, from the file source's log (``sources/0/<id>`` and compacted ``<id>.compact``)."""
    out: dict[str, int] = {}
    log = checkpoint / "sources" / "0"
    if not log.is_dir():
        return out
    for f in log.iterdir():
        if f.name.startswith("."):
            continue
        try:
            lines = f.read_text().splitlines()[1:]   # the first line is the log's version
        except OSError:
            continue
        for line in lines:
            try:
                entry = json.loads(line)
            except ValueError:
                continue   # a file being written
            out[entry["path"].rsplit("/", 1)[-1]] = int(entry["batchId"])
    return out


def file_sink_commits(output: pathlib.Path) -> dict[int, float]:
    """Batch id -> the time the file sink committed it (``_spark_metadata/<id>[.compact]``'s modification time)."""
    meta = output / "_spark_metadata"
    out = {}
    if meta.is_dir():
        for f in meta.iterdir():
            stem = f.name.removesuffix(".compact")
            if stem.isdigit():
                out[int(stem)] = f.stat().st_mtime
    return out


@dataclass
class RunResult:
    candidate: str
    rate: int
    latencies: list[float]          # per file, seconds (each file's events share it)
    events_per_file: int
    files: int
    missing: int
    batches: int
    cpu: dict[str, float]
    events: int
    notes: list[str] = field(default_factory=list)
    #: Per batch: Spark's progress (trigger start, durationMs, rows) and, for keygroups, the batch's report;
    #: per file: write time, batch, latency (see :func:`timeline`).
    batches_timeline: list[dict[str, Any]] = field(default_factory=list)
    files_timeline: list[dict[str, Any]] = field(default_factory=list)
    round: int = 0   # of --repeat; -1: several runs pooled

    def percentile(self, q: float) -> float:
        return float(np.percentile(self.latencies, q)) if self.latencies else float("nan")


# ---- the candidates: each starts a query and returns (stop, commit times) --------------------------------------------

class Candidate:
    def __init__(self, spark: Any, source: pathlib.Path, work: pathlib.Path, args: argparse.Namespace) -> None:
        self.spark, self.source, self.work, self.args = spark, source, work, args
        self.checkpoint = work / "spark-checkpoint"
        self.commits: dict[int, float] = {}
        self.results: dict[int, Any] = {}   # keygroups: batch id -> BatchResult
        self.prunes: list[tuple[float, float]] = []   # keygroups: its retention runs, (start epoch s, seconds)
        self.calls: dict[int, tuple[float, float]] = {}   # foreachBatch: batch id -> (entered, returned), epoch s
        self.query: Any = None
        self.notes: list[str] = []

    def reports(self) -> dict[int, dict[str, Any]]:
        """keygroups: each batch's figures (its report, Spark's time for its jobs, the foreachBatch call's times)."""
        out = {}
        for batch, result in self.results.items():
            out[batch] = report_figures(result)
            if batch in self.calls:
                out[batch]["entered"], out[batch]["returned"] = self.calls[batch]
                out[batch]["committed"] = self.commits.get(batch)
        return out

    def progress(self) -> list[dict[str, Any]]:
        """Spark's StreamingQueryProgress of every batch the query kept (``numRecentProgressUpdates``)."""
        from pyspark.sql.streaming import StreamingQuery

        jquery = self.query._jsq if isinstance(self.query, StreamingQuery) else self.query   # else started by py4j
        return [json.loads(p.json()) for p in jquery.recentProgress()]

    def stream(self) -> Any:
        return (self.spark.readStream.schema("key long, value long, ts long").parquet(str(self.source)))

    def start(self) -> None:
        raise NotImplementedError

    def committed(self) -> dict[int, float]:
        return self.commits

    def failed(self) -> str | None:
        if self.query is None:
            return None
        exc = self.query.exception()
        if exc is not None:
            return str(exc)
        return None if self.query.isActive else "the query stopped"

    def stop(self) -> None:
        if self.query is not None:
            self.query.stop()


def report_figures(result: Any) -> dict[str, Any]:
    """What a keygroups batch's report says about where its time went (see BatchReport, SubtaskReport)."""
    r = result.report
    return {"wall": r.wall_seconds, "spark": r.spark_seconds, "phases": dataclasses.asdict(r.seconds),
            "parallelism": r.parallelism, "warm": r.key_groups_warm, "caught_up": r.key_groups_caught_up,
            "cold": r.key_groups_cold, "bytes_restored": r.bytes_restored, "records": r.records_in,
            "subtasks": [{"restore": s.restored.mode, "read": s.restored.bytes_read,
                          "seconds": dataclasses.asdict(s.seconds)} for s in result.reports]}


class Keygroups(Candidate):
    rescale = False
    output_sink = False
    rescaled = RESCALED   # the parallelism a rescale switches to from PARALLELISM, and back

    def start(self) -> None:
        from keygroups.spark import KeyedJob

        job = KeyedJob("latency", "key", RunningValue(), output_schema=VALUE_OUTPUT, max_parallelism=MAX_PARALLELISM,
                       checkpoint_location=str(self.work / "keygroups"))
        if self.rescale and self.args.plan_ahead:   # the query knows the parallelisms it switches between
            job.plan_ahead(PARALLELISM, self.rescaled)
        self.parallelisms: list[int] = []
        # Observed: when the job's retention (in a thread of the driver, after each commit) runs, and for how long.
        prune = job.storage.prune

        def timed_prune(*a: Any, **k: Any) -> Any:
            started = time.time()
            try:
                return prune(*a, **k)
            finally:
                self.prunes.append((started, time.time() - started))

        job.storage.prune = timed_prune
        if self.output_sink:   # the former measure: the sink gets result.output, built before it is called
            def sink(output: Any, batch_id: int, result: Any) -> None:
                self.commits[batch_id] = time.time()
                self.parallelisms.append(result.parallelism)
                self.results[int(batch_id)] = result   # its figures are read after the run, off the batch's path

            run = job.foreach_batch(sink, parallelism=PARALLELISM)

            def function(df: Any, batch_id: int) -> None:
                entered = time.time()
                run(df, batch_id)
                self.calls[int(batch_id)] = (entered, time.time())
        elif not self.rescale:
            # No sink function: the output stays in the checkpoint, committed with it, and is not read back (as
            # TWS's Parquet files are not). The batch's result is observed as the job's run returns it.
            committed = job._run

            def observed(*a: Any, **k: Any) -> Any:
                result = committed(*a, **k)
                batch_id = k["streaming"].batch_id
                self.commits[batch_id] = time.time()
                self.parallelisms.append(result.parallelism)
                self.results[batch_id] = result   # its figures are read after the run, off the batch's path
                return result

            job._run = observed
            run = job.foreach_batch(parallelism=PARALLELISM)

            def function(df: Any, batch_id: int) -> None:
                entered = time.time()
                run(df, batch_id)
                self.calls[int(batch_id)] = (entered, time.time())
        else:
            started = time.time()
            every = self.args.rescale_every
            rescaled = self.rescaled

            def function(df: Any, batch_id: int) -> None:
                entered = time.time()
                p = PARALLELISM if int((time.time() - started) // every) % 2 == 0 else rescaled
                result = job.run_batch(df, parallelism=p, checkpoint_id=int(batch_id))
                self.commits[batch_id] = time.time()
                self.parallelisms.append(result.parallelism)
                self.results[int(batch_id)] = result
                self.calls[int(batch_id)] = (entered, time.time())

        self.query = (self.stream().writeStream.foreachBatch(function)
                      .option("checkpointLocation", str(self.checkpoint))
                      .trigger(processingTime=f"{self.args.trigger_ms} milliseconds").start())

    def stop(self) -> None:
        super().stop()
        changes = sum(1 for a, b in zip(self.parallelisms, self.parallelisms[1:]) if a != b)
        self.notes.append(f"parallelism changed {changes} times")


class KeygroupsRescale(Keygroups):
    rescale = True


class KeygroupsOutputSink(Keygroups):
    output_sink = True


def rescale_name(n: int) -> str:
    """The candidate that rescales between PARALLELISM and ``n`` (``--rescale-to``)."""
    return f"keygroups rescale {PARALLELISM}<->{n}"


def rescale_kind(n: int) -> type[Candidate]:
    """``keygroups rescale`` between PARALLELISM and ``n`` instead of RESCALED."""
    return type(f"KeygroupsRescale{n}", (KeygroupsRescale,), {"rescaled": n})


class SparkTws(Candidate):
    def start(self) -> None:
        self.output = self.work / "tws-output"
        self.spark.conf.set("spark.sql.streaming.stateStore.providerClass", ROCKSDB_PROVIDER)
        jvm = self.spark.sparkContext._jvm
        self.query = jvm.LatencyTws.start(self.spark._jsparkSession, str(self.source), str(self.checkpoint),
                                          str(self.output), int(self.args.trigger_ms))

    def committed(self) -> dict[int, float]:
        return file_sink_commits(self.output)

    def failed(self) -> str | None:
        exc = self.query.exception()
        if exc.isDefined():
            return exc.get().toString()
        return None if self.query.isActive() else "the query stopped"


class SparkGroupBy(Candidate):
    def start(self) -> None:
        from pyspark.sql import functions as F

        output = str(self.work / "groupby-output")

        def function(df: Any, batch_id: int) -> None:
            df.groupBy("key").agg(F.count(F.lit(1)).alias("count"), F.sum("value").alias("sum")) \
                .write.mode("append").parquet(output)
            self.commits[batch_id] = time.time()

        self.query = (self.stream().writeStream.foreachBatch(function)
                      .option("checkpointLocation", str(self.checkpoint))
                      .trigger(processingTime=f"{self.args.trigger_ms} milliseconds").start())


KINDS: dict[str, type[Candidate]] = {"keygroups": Keygroups, "keygroups rescale": KeygroupsRescale,
                                     "keygroups output sink": KeygroupsOutputSink,
                                     "Spark TWS (JVM)": SparkTws, "Spark groupBy": SparkGroupBy}


def run_one(spark: Any, name: str, rate: int, args: argparse.Namespace, root: pathlib.Path, seed: int) -> RunResult:
    work = root / f"{name.replace(' ', '-').replace('(', '').replace(')', '').replace('<->', '-')}-{rate}"
    source = work / "source"
    source.mkdir(parents=True)
    log = work / "writes.json"
    candidate = KINDS[name](spark, source, work, args)
    tree = TreeCPU()
    gc_pauses = GcPauses().__enter__()
    candidate.start()
    # One warm-up file first, committed before the generator starts: the query's first batch (planning, code
    # generation, the first Python workers) is its start-up, reported apart from the latencies.
    pq.write_table(pa.table({"key": [0], "value": [0], "ts": [0]}, schema=SCHEMA), source / ".warm.tmp")
    os.replace(source / ".warm.tmp", source / "part-warmup.parquet")
    written = time.time()
    while True:
        batch = batch_of_files(candidate.checkpoint).get("part-warmup.parquet")
        if batch is not None and batch in candidate.committed():
            break
        if candidate.failed() or time.time() - written > 600:
            candidate.stop()
            raise SystemExit(f"{name} at {rate}/s: the warm-up batch did not commit: {candidate.failed()}")
        time.sleep(0.2)
    first_batch = candidate.committed()[batch] - written
    cpu0 = tree.sample()
    ctx = multiprocessing.get_context("spawn")
    gen = ctx.Process(target=generate, args=(str(source), str(log), rate, args.file_ms, args.duration, args.keys, seed))
    gen.start()
    try:
        while gen.is_alive():
            gen.join(1)
            if candidate.failed():
                gen.terminate()
                raise SystemExit(f"{name} at {rate}/s failed: {candidate.failed()[:3000]}")
        logged = json.loads(log.read_text())
        writes = logged["writes"]
        deadline = time.time() + args.drain
        while time.time() < deadline:
            batches, commits = batch_of_files(candidate.checkpoint), candidate.committed()
            if all(w[0] in batches and batches[w[0]] in commits for w in writes):
                break
            time.sleep(0.5)
        cpu = TreeCPU.delta(cpu0, tree.sample())
        cpu["driver"] -= logged["cpu"]   # the generator, reaped by this process, is not the driver's work
    finally:
        candidate.stop()
        gc_pauses.__exit__()
    batches, commits = batch_of_files(candidate.checkpoint), candidate.committed()
    reports = candidate.reports()
    batch_timeline = [batch_figures(p, commits, reports) for p in candidate.progress()]
    for b in batch_timeline:   # the driver's Python GC, and keygroups' retention, during the batch's trigger
        end = b["start"] + (b["ms"]["triggerExecution"] or 0) / 1e3
        b["gc_ms"] = 1e3 * gc_pauses.within(b["start"], end)
        b["prune_ms"] = 1e3 * sum(max(0.0, min(t + d, end) - max(t, b["start"])) for t, d in candidate.prunes)
    first = writes[0][1] if writes else 0.0
    latencies, missing = [], 0
    starts = {b["batch"]: b["start"] for b in batch_timeline}
    files_timeline = []
    for name_, written, _events in writes:
        if written - first < args.warmup:
            continue
        batch = batches.get(name_)
        if batch is None or batch not in commits:
            missing += 1
            continue
        latencies.append(commits[batch] - written)
        files_timeline.append({"file": name_, "written": written, "batch": batch, "latency": latencies[-1],
                               "wait": starts[batch] - written if batch in starts else None})
    used = {batches[w[0]] for w in writes if w[0] in batches}
    events = sum(w[2] for w in writes)
    result = RunResult(name, rate, latencies, writes[0][2] if writes else 0, len(writes), missing, len(used),
                       cpu, events, [f"first batch {first_batch:.1f} s", *candidate.notes], batch_timeline,
                       files_timeline)
    shutil.rmtree(work, ignore_errors=True)
    return result


class GcPauses:
    """The driver's Python garbage collections while installed: (generation, start epoch s, seconds) each."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float, float]] = []
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.time()
        else:
            self.pauses.append((info["generation"], self._started, time.time() - self._started))

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)

    def within(self, start: float, end: float) -> float:
        return sum(d for _, t, d in self.pauses if start <= t < end)


# ---- per-batch timelines: where the slowest files' latency went ------------------------------------------------------

DURATIONS = ("latestOffset", "getBatch", "queryPlanning", "addBatch", "walCommit", "commitOffsets", "triggerExecution")


def _epoch(timestamp: str) -> float:
    return datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def batch_figures(progress: dict[str, Any], commits: dict[int, float],
                  reports: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One batch: its trigger's start (epoch s), Spark's durationMs, rows, commit time (None: not committed, or a
    batch without data) and, for keygroups, its report's figures; the state operators' figures for TWS."""
    batch = int(progress["batchId"])
    out = {"batch": batch, "start": _epoch(progress["timestamp"]), "rows": progress.get("numInputRows", 0),
           "ms": {k: progress.get("durationMs", {}).get(k) for k in DURATIONS}, "commit": commits.get(batch),
           "report": reports.get(batch)}
    ops = progress.get("stateOperators") or []
    if ops:
        out["state"] = {k: ops[0].get(k) for k in ("allUpdatesTimeMs", "allRemovalsTimeMs", "commitTimeMs",
                                                    "numRowsTotal", "memoryUsedBytes")}
        out["state"]["custom"] = ops[0].get("customMetrics")
    return out


def _median(values: list[float]) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def tail_summary(r: RunResult, share: float = 0.05) -> list[str]:
    """Lines saying where the slowest ``share`` of files' latency went: their wait for their batch to start (the
    previous batches still running, or the trigger) and their batch's own run, per Spark phase and, for keygroups,
    per report phase; beside the same figures over all batches."""
    if not r.files_timeline:
        return []
    by_batch = {b["batch"]: b for b in r.batches_timeline}
    files = sorted(r.files_timeline, key=lambda f: f["latency"])
    cut = files[int(len(files) * (1 - share))]["latency"]
    slow = [f for f in files if f["latency"] >= cut]
    slow_batches = sorted({f["batch"] for f in slow})
    data_batches = [b for b in r.batches_timeline if b["rows"]]
    lines = [f"    slowest {share:.0%} of files (latency >= {cut * 1e3:.0f} ms): {len(slow)} files in batches "
             f"{slow_batches[:20]}{' ...' if len(slow_batches) > 20 else ''}; median wait for their batch "
             f"{_median([f['wait'] for f in slow]) * 1e3:.0f} ms (all files "
             f"{_median([f['wait'] for f in files]) * 1e3:.0f})"]

    def phases(bs: list[dict[str, Any]]) -> str:
        parts = [f"{k} {_median([b['ms'][k] for b in bs]):.0f}" for k in DURATIONS if any(b['ms'][k] for b in bs)]
        run = _median([(b["commit"] - b["start"]) * 1e3 for b in bs if b["commit"]])
        return f"start->commit {run:.0f}; " + ", ".join(parts)

    tail = [by_batch[b] for b in slow_batches if b in by_batch]
    # a file's wait is its previous batch still running: the batch before each slow one matters as much
    before = [by_batch[b - 1] for b in slow_batches if b - 1 in by_batch and b - 1 not in slow_batches]
    lines.append(f"      all {len(data_batches)} batches, median ms: {phases(data_batches)}")
    lines.append(f"      the slow files' {len(tail)} batches:      {phases(tail)}")
    if before:
        lines.append(f"      the {len(before)} batches before them:   {phases(before)}")
    for b in sorted(tail + before, key=lambda b: -(b["ms"]["triggerExecution"] or 0))[:8]:
        extra = ""
        rep = b.get("report")
        if rep:
            ph = rep["phases"]
            modes = ",".join(s["restore"] for s in rep["subtasks"])
            extra = (f" | kg wall {rep['wall'] * 1e3:.0f} spark {1e3 * (rep['spark'] or 0):.0f} "
                     + " ".join(f"{k} {v * 1e3:.0f}" for k, v in ph.items() if v >= 0.0005)
                     + f" p={rep['parallelism']} restore {modes} cold {rep['cold']} caught {rep['caught_up']}")
        if b.get("state"):
            st = b["state"]
            extra += f" | state upd {st['allUpdatesTimeMs']} commit {st['commitTimeMs']}"
        if b.get("gc_ms", 0) >= 1:
            extra += f" | driver GC {b['gc_ms']:.0f}"
        if b.get("prune_ms", 0) >= 1:
            extra += f" | retention {b['prune_ms']:.0f}"
        ms = ", ".join(f"{k} {v}" for k, v in b["ms"].items() if v)
        lines.append(f"      batch {b['batch']}: rows {b['rows']}; {ms}{extra}")
    return lines


def report_run(r: RunResult, args: argparse.Namespace) -> None:
    print(f"  {r.candidate:<23} {r.rate:>6}/s round {r.round}: p50 {r.percentile(50) * 1e3:7.0f} ms  p99 "
          f"{r.percentile(99) * 1e3:7.0f} ms  {r.batches} batches, {r.missing} files missing; "
          f"{'; '.join(r.notes)}; {load()}", flush=True)
    if args.tail:
        print("\n".join(tail_summary(r)), flush=True)


def pooled(runs: list[RunResult]) -> RunResult:
    """The runs of one candidate and rate as one: their files' latencies together."""
    first = runs[0]
    return RunResult(first.candidate, first.rate, [x for r in runs for x in r.latencies], first.events_per_file,
                     sum(r.files for r in runs), sum(r.missing for r in runs), sum(r.batches for r in runs),
                     {k: sum(r.cpu[k] for r in runs) for k in first.cpu}, sum(r.events for r in runs), round=-1)


# ---- part 2: small-batch throughput --------------------------------------------------------------------------------

def keygroups_throughput(spark: Any, files: list[str], location: str) -> tuple[float, dict[str, float], int]:
    from keygroups.spark import KeyedJob

    job = KeyedJob("throughput", "key", RunningValue(), output_schema=VALUE_OUTPUT, max_parallelism=MAX_PARALLELISM,
                   checkpoint_location=location)
    job.run_batch(spark.read.parquet(files[0]), parallelism=PARALLELISM)   # untimed: first batch, workers start
    tree = TreeCPU()
    cpu0 = tree.sample()
    events = 0
    t0 = time.perf_counter()
    for f in files[1:]:
        events += job.run_batch(spark.read.parquet(f), parallelism=PARALLELISM).records_in
    wall = time.perf_counter() - t0
    return wall, TreeCPU.delta(cpu0, tree.sample()), events


def pyflink_throughput(files: list[str], work: pathlib.Path) -> tuple[float, float, float, int]:
    """(net runtime s, JVM CPU s, start-up net runtime s on 1,000 events, events) of the PyFlink thread-mode job."""
    from bench_record_path import pyflink, write_pairs

    python = pyflink_python()
    pairs, tiny = work / "pyflink-events.bin", work / "pyflink-tiny.bin"
    write_pairs(files, pairs)
    write_pairs(files, tiny, 1_000)
    run = pyflink(python, pairs, "hashmap", "thread", job="value")
    fixed = pyflink(python, tiny, "hashmap", "thread", job="value")
    keys = np.unique(pq.read_table(files, columns=["key"]).column("key").to_numpy()).size
    if run.records != sum(pq.ParquetFile(f).metadata.num_rows for f in files) or run.checksum != keys:
        raise SystemExit(f"PyFlink: {run.records} output rows over {run.checksum} keys; expected one per event over "
                         f"{keys} keys")
    return run.wall, run.cpu, fixed.wall, run.records


# ---- the run --------------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="30 s runs, rescale every 10 s, 5 throughput batches")
    parser.add_argument("--rates", type=int, nargs="+", default=[1_000, 10_000], help="events per second")
    parser.add_argument("--keys", type=int, default=50_000)
    parser.add_argument("--duration", type=float, default=150.0, help="seconds the generator writes, per run")
    parser.add_argument("--warmup", type=float, default=5.0,
                        help="leave out files of the generator's first seconds (after the warm-up batch)")
    parser.add_argument("--drain", type=float, default=60.0, help="seconds to wait for the last files' commits")
    parser.add_argument("--file-ms", type=int, default=100, help="a source file every this many ms")
    parser.add_argument("--trigger-ms", type=int, default=200, help="the processing-time trigger of every query")
    parser.add_argument("--rescale-every", type=float, default=60.0)
    parser.add_argument("--plan-ahead", action=argparse.BooleanOptionalAction, default=True,
                        help="the rescaling candidates tell their job the two parallelisms (KeyedJob.plan_ahead)")
    parser.add_argument("--rescale-to", type=int, nargs="*", default=[],
                        help=f"also run 'keygroups rescale' between {PARALLELISM} and each of these (beside the "
                             f"{PARALLELISM}<->{RESCALED} run, not instead of it: e.g. 1 or 3 on a 2-core machine)")
    parser.add_argument("--skip", nargs="*", default=[], choices=CANDIDATES, help="candidates to leave out")
    parser.add_argument("--session-warmup", action=argparse.BooleanOptionalAction, default=True,
                        help="start and stop each kind of query once first, untimed")
    parser.add_argument("--throughput", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--throughput-batches", type=int, default=20)
    parser.add_argument("--batch", type=int, default=10_000, help="events per batch in the throughput part")
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--spark-conf", action="append", default=[], metavar="KEY=VALUE", type=spark_setting,
                        help="a Spark setting for the session (repeatable), e.g. "
                             "spark.python.unix.domain.socket.enabled=true (docs/streaming-job.md)")
    parser.add_argument("--also", nargs="*", default=[], choices=EXTRA, help="candidates run only when named")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs per candidate and rate, the order rotating per round; figures pooled and per round")
    parser.add_argument("--tail", action=argparse.BooleanOptionalAction, default=True,
                        help="print where the slowest 5%% of files' latency went, per run")
    parser.add_argument("--timeline", help="write every run's per-batch and per-file timeline to this JSON file")
    args = parser.parse_args(argv)
    if args.quick:   # the quick sizes, where not given explicitly
        quick = {"duration": 30.0, "rescale_every": 10.0, "warmup": 2.0, "drain": 30.0, "throughput_batches": 5}
        for name, value in quick.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)

    root = pathlib.Path(tempfile.mkdtemp(prefix="kg-bench-latency-"))
    for n in args.rescale_to:
        if not 1 <= n <= MAX_PARALLELISM or n == PARALLELISM:
            parser.error(f"--rescale-to {n}: a parallelism in [1, {MAX_PARALLELISM}] other than {PARALLELISM}")
        KINDS[rescale_name(n)] = rescale_kind(n)
    candidates = [c for c in CANDIDATES if c not in args.skip]
    extra_rescales = [rescale_name(n) for n in dict.fromkeys(args.rescale_to) if n != RESCALED]
    at = candidates.index("keygroups rescale") + 1 if "keygroups rescale" in candidates else 0
    candidates = candidates[:at] + extra_rescales + candidates[at:] + list(args.also)
    classes = build_java("LatencyTws.java", spark_classpath()) if "Spark TWS (JVM)" in candidates else None
    ship_by_value()
    spark = spark_session(args.master, "keygroups-bench-latency", shuffle_partitions=PARALLELISM,
                          extra_classpath=[classes] if classes else None,
                          conf={"spark.sql.streaming.noDataMicroBatches.enabled": "false",
                                "spark.sql.streaming.numRecentProgressUpdates": "100000",
                                **dict(args.spark_conf)})
    print(f"{args.keys:,} keys; rates {args.rates} events/s; a file every {args.file_ms} ms; trigger "
          f"{args.trigger_ms} ms; {args.duration:.0f} s per run ({args.warmup:.0f} s warm-up left out); rescale "
          f"every {args.rescale_every:.0f} s; {load()} (2 cores, shared machine)", flush=True)
    results: list[RunResult] = []
    throughput = None
    try:
        if args.session_warmup:   # each kind of query once, untimed: the session's first queries pay the JVM's warm-up
            idle = argparse.Namespace(**{**vars(args), "duration": 0.0, "drain": 0.0})
            firsts = [f"{name} {run_one(spark, name, args.rates[0], idle, root, seed=0).notes[0]}"
                      for name in candidates]
            print(f"  session warm-up: {'; '.join(firsts)}; {load()}", flush=True)
        for i, rate in enumerate(args.rates):
            for round_ in range(args.repeat):   # the order rotates per rate and per round: none always runs first
                k = (i + round_) % len(candidates)
                for name in candidates[k:] + candidates[:k]:
                    r = run_one(spark, name, rate, args, root, seed=rate + round_)
                    r.round = round_
                    results.append(r)
                    report_run(r, args)
        if args.throughput:

            generate_events(root / "events", (args.throughput_batches + 1) * args.batch, args.keys,
                            args.throughput_batches + 1)
            files = event_files(root / "events")
            throughput = keygroups_throughput(spark, files, str(root / "throughput"))
            print(f"  keygroups throughput: {throughput[2]:,} events in {throughput[0]:.1f} s", flush=True)
    finally:
        spark.stop()
    if args.timeline:
        pathlib.Path(args.timeline).write_text(json.dumps(
            [{"candidate": r.candidate, "rate": r.rate, "batches": r.batches_timeline, "files": r.files_timeline}
             for r in results]))
    flink = pyflink_throughput(files[1:], root) if args.throughput else None
    shutil.rmtree(root, ignore_errors=True)

    print(f"\n== 1. latency, event written to the source -> its output committed; {args.keys:,} keys, one "
          f"ValueState per record; trigger {args.trigger_ms} ms; {load()}")
    print(f"{'candidate':<25}{'events/s':>9}{'p50 ms':>8}{'p99 ms':>8}{'max ms':>8}{'batches':>8}{'ev/batch':>9}"
          f"{'missing':>8}{'CPU s per 1k events: driver':>29}{'JVM':>7}{'workers':>9}")
    table = results
    if args.repeat > 1:
        table = results + [pooled([r for r in results if r.rate == rate and r.candidate == name])
                           for rate in args.rates for name in candidates]
    for r in table:
        k = r.events / 1000
        mx = max(r.latencies) * 1e3 if r.latencies else float("nan")
        label = r.candidate if args.repeat == 1 else f"{r.candidate} {'all' if r.round < 0 else f'#{r.round}'}"
        print(f"{label:<28}{r.rate:>6,}{r.percentile(50) * 1e3:>8.0f}{r.percentile(99) * 1e3:>8.0f}{mx:>8.0f}"
              f"{r.batches:>8}{r.events / max(r.batches, 1):>9,.0f}{r.missing:>8}{r.cpu['driver'] / k:>29.3f}"
              f"{r.cpu['jvm'] / k:>7.3f}{r.cpu['python workers'] / k:>9.3f}")
    print("  issue 32's target: keygroups p50 and p99 <= Spark TWS (JVM) on the same machine:")
    for rate in args.rates:
        runs = {name: [r for r in results if r.rate == rate and r.candidate == name] for name in candidates}
        tws = runs.get("Spark TWS (JVM)")
        for name in ("keygroups", "keygroups rescale", *extra_rescales):
            if runs.get(name) and tws:
                a, b = pooled(runs[name]), pooled(tws)
                p50, p99 = a.percentile(50) / b.percentile(50), a.percentile(99) / b.percentile(99)
                verdict = "meets" if p50 <= 1 and p99 <= 1 else "misses"
                line = f"    {rate:,}/s {name}: p50 {p50:.2f}x, p99 {p99:.2f}x of TWS: {verdict}"
                if args.repeat > 1:   # each round's ratio (its two runs ran back to back), and their median
                    pairs = [(x.percentile(50) / y.percentile(50), x.percentile(99) / y.percentile(99))
                             for x, y in zip(runs[name], tws)]
                    line += (f" (pooled over {len(pairs)} rounds; per round p50 "
                             f"{', '.join(f'{q[0]:.2f}' for q in pairs)}, p99 "
                             f"{', '.join(f'{q[1]:.2f}' for q in pairs)}; median of rounds p50 "
                             f"{statistics.median(q[0] for q in pairs):.2f}x, p99 "
                             f"{statistics.median(q[1] for q in pairs):.2f}x)")
                print(line)
    if throughput is not None and flink is not None:
        wall, cpu, events = throughput
        net, fcpu, fixed, fevents = flink
        ours, theirs = events / wall, fevents / net
        steady = (fevents - 1_000) / max(net - fixed, 1e-9)
        print(f"\n== 2. small-batch throughput: {args.batch:,}-event batches, {args.keys:,} keys, p={PARALLELISM}; "
              f"{load()}")
        print(f"  keygroups KeyedJob.run_batch x{args.throughput_batches}: {ours:,.0f} events/s ({wall:.1f} s; CPU s "
              f"driver {cpu['driver']:.1f}, JVM {cpu['jvm']:.1f}, workers {cpu['python workers']:.1f})")
        print(f"  PyFlink thread mode, same events as one stream: {theirs:,.0f} events/s (net runtime {net:.1f} s, "
              f"JVM CPU {fcpu:.1f} s); net of its start-up ({fixed:.1f} s on 1,000 events) {steady:,.0f} events/s")
        verdict = "meets" if ours >= theirs else "misses"
        print(f"  keygroups / PyFlink thread: {ours / theirs:.2f}x ({ours / steady:.2f}x against PyFlink net of "
              f"start-up); target >= 1: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
