"""Rescaling at production size (issue 34): load, steady batches and rescale batches of a keyed job with 1M-50M keys,
on both backends, on Spark local[2], beside Spark's own offline repartition of a transformWithState RocksDB state.

    python benchmarks/bench_rescale_scale.py                                  # 1M keys, both backends
    python benchmarks/bench_rescale_scale.py --keys 1000000 10000000 50000000
    python benchmarks/bench_rescale_scale.py --keys 1000000 --spark-repartition   # + Spark's offline repartition
    python benchmarks/bench_rescale_scale.py --keys 50000000 --spark-only --driver-memory 8g   # Spark's alone

Per key count and backend, one job (a running count and sum per key: two int64 ValueStates, one output row per
event; max parallelism 128):

* **load**: the state of every key written as a savepoint by ``keygroups.spark.write_savepoint`` from
  ``spark.range`` (generated in Spark, in bulk), then the job's first batch at p=2, which restores that savepoint
  cold and writes its first checkpoint (full: a savepoint's files are not shared with checkpoints);
* **memory per key**: heap, the resident growth of Spark's Python workers (which keep the heap backends warm) over
  the key count; RocksDB, the bytes of its databases on local disk, and the workers' resident growth;
* **steady**: a batch of 100k events (keys drawn uniformly) at p=2, warm, median of ``--steady`` batches;
* **forwarded**: heap subtasks Spark placed on a Python worker that does not hold their state, run in the worker
  that does (``KeyedJob(forward_to_warm_process=True)``, the default; ``--forward off`` or ``both`` for the
  comparison);
* **rescale**: the 2 -> 3, 3 -> 2 and 2 -> 4 batches (100k events each): time, bytes read (``bytes_restored``)
  against the bytes of the key groups that changed holder (the batch's assignment decision: a subtask takes over
  the warm state of the previous range it shares most with, so a key group moves when its holder changes), beside
  those whose subtask index changes (each key group's chain in the checkpoint restored from), and the batch's cost
  against the steady one.

Times: wall, and CPU of the whole process tree (driver, JVM, Python workers; from /proc), since the work runs in
Spark's worker processes. The machine is shared: the load average is printed with every figure.

Spark's baseline (``--spark-repartition``, pyspark 4.2+): a JVM transformWithState query
(``benchmarks/java/RepartitionStateTws.java``: one ValueState (count, sum) per key, RocksDB state store provider,
2 shuffle partitions; spark_tws_baseline.run_tws_jvm) builds the state of the same key count from events holding each
key once, then ``spark._streamingCheckpointManager.repartition(checkpoint, 3)`` rewrites all of its state offline
(spark_repartition_baseline.run_spark_repartition), ``--spark-runs`` times, each on a fresh copy of the checkpoint.
After each, the state is read back through Spark's state data source (``format("statestore")``) and checked:
key count, checksums of keys and values, a sample of keys (spark_tws_baseline.state_summary), 3 partitions. Printed:
the build (wall, CPU), the repartition's median wall, CPU of the whole process tree, bytes read, state bytes before
and after, and beside each keygroups rescale batch the ratio Spark / keygroups. ``--spark-only`` runs only this
baseline (no keygroups job) at each ``--keys``. At 50M keys give the JVM room: ``--driver-memory 8g``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from keygroups import KeyGroupRange, operator_index_for_key_group  # noqa: E402
from keygroups.checkpoint import CheckpointMetadata, chain_stats  # noqa: E402
from keygroups.runtime import KeyedProcessFunction  # noqa: E402
from keygroups.serializers import Int64Serializer  # noqa: E402
from keygroups.state import ValueStateDescriptor  # noqa: E402

MAXP = 128
EVENTS = 100_000
OUTPUT = pa.schema([("k", pa.int64()), ("count", pa.int64()), ("sum", pa.int64())])
_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


class RunningCountSum(KeyedProcessFunction):
    """Per key, the running count and sum of its events' ``v``, emitted with every event."""

    def open(self, context: Any) -> None:
        self.count = context.get_state(ValueStateDescriptor("count", Int64Serializer()))
        self.sum = context.get_state(ValueStateDescriptor("sum", Int64Serializer()))

    def process_element(self, record: Any, context: Any) -> Any:
        count = (self.count.value() or 0) + 1
        total = (self.sum.value() or 0) + record["v"]
        self.count.update(count)
        self.sum.update(total)
        return [(context.current_key, count, total)]


# ---- measuring --------------------------------------------------------------------------------------------------

def _processes() -> dict[int, tuple[int, list[str]]]:
    """pid -> (parent pid, /proc/<pid>/stat fields after the command name) of every process."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(entry)] = (int(fields[1]), fields)
    return out


def _tree(procs: dict[int, tuple[int, list[str]]]) -> list[int]:
    root = os.getpid()
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in procs.items():
        children.setdefault(parent, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def tree_cpu() -> float:
    """CPU seconds (user + system) of this process and every live descendant (the JVM, Spark's Python workers),
    with what their finished children used."""
    procs = _processes()
    ticks = 0
    for pid in _tree(procs):
        f = procs[pid][1]
        ticks += int(f[11]) + int(f[12]) + int(f[13]) + int(f[14])   # utime stime cutime cstime
    return ticks / _TICK


def worker_rss() -> tuple[int, int]:
    """Resident bytes of the Python processes under the JVM (Spark's Python daemon and workers): all of them, and
    the anonymous ones (``RssAnon``: without memory-mapped files' pages, which the kernel drops under pressure)."""
    procs = _processes()
    total = anon = 0
    for pid in _tree(procs):
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/comm") as f:
                if not f.read().startswith("python"):
                    continue
            with open(f"/proc/{pid}/status") as f:
                anon += next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))
        except (OSError, StopIteration):
            continue
        total += int(procs[pid][1][21]) * _PAGE   # rss pages
    return total, anon


def load_average() -> str:
    return "load %.1f" % os.getloadavg()[0]


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass
    return total


def moved_bytes(metadata: CheckpointMetadata, old_p: int, new_p: int) -> int:
    """Bytes (chains in ``metadata``) of the key groups whose subtask index changes from ``old_p`` to ``new_p``."""
    chains = chain_stats(metadata, KeyGroupRange(0, MAXP - 1))
    return sum(c.full_bytes + c.delta_bytes for kg, c in chains.items()
               if operator_index_for_key_group(MAXP, old_p, kg) != operator_index_for_key_group(MAXP, new_p, kg))


# ---- the job ------------------------------------------------------------------------------------------------------

def session(driver_memory: str = "4g", extra_classpath: list[str] | None = None) -> Any:
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = (SparkSession.builder.master("local[2]").appName("bench-rescale-scale")
               .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
               .config("spark.driver.memory", driver_memory).config("spark.sql.shuffle.partitions", "4")
               .config("spark.sql.execution.arrow.pyspark.enabled", "true")
               .config("spark.sql.session.timeZone", "UTC"))
    if extra_classpath:   # must be set before the JVM starts
        builder = builder.config("spark.driver.extraClassPath", os.pathsep.join(extra_classpath))
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def key_of(ids: Any) -> Any:
    return ids * 7919 + 11


def events(spark: Any, n_keys: int, seed: int) -> Any:
    """EVENTS events over keys drawn uniformly from the n_keys loaded (an Arrow table: bulk, not per record)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, n_keys, EVENTS, dtype=np.int64)
    return spark.createDataFrame(pa.table({"k": key_of(ids), "v": rng.integers(1, 100, EVENTS, dtype=np.int64)}))


def write_load(spark: Any, location: str, n_keys: int) -> dict[str, float]:
    from keygroups.spark import write_savepoint

    df = spark.range(n_keys).selectExpr("id * 7919 + 11 AS k", "id % 1000 AS count", "id * 3 AS sum")
    cpu, wall = tree_cpu(), time.perf_counter()
    write_savepoint(df, location, "load", key_columns="k", states={"count": "count", "sum": "sum"},
                    max_parallelism=MAXP, parallelism=2)
    return {"wall": time.perf_counter() - wall, "cpu": tree_cpu() - cpu}


def timed_batch(job: Any, df: Any, parallelism: int) -> dict[str, Any]:
    before = job.latest_checkpoint()
    cpu, wall = tree_cpu(), time.perf_counter()
    result = job.run_batch(df, parallelism=parallelism)
    out = {"wall": time.perf_counter() - wall, "cpu": tree_cpu() - cpu, "report": result.report,
           "load": load_average(), "forwarded": sum(r.forwarded_from is not None for r in result.reports),
           "subtasks": len(result.reports)}
    if before is not None:
        out["moved"] = moved_bytes(before, before.parallelism, parallelism)
    decision = result.report.assignment
    if decision is not None and decision.previous is not None:   # the warm takeover's: what changed holder
        out["moved_holder"] = decision.moved_bytes
    return out


def run_backend(spark: Any, n_keys: int, backend: str, work: pathlib.Path, steady_batches: int,
                forward: bool = True) -> dict[str, Any]:
    from keygroups.spark import KeyedJob

    location = str(work / f"ck-{backend}")
    local_dir = work / f"local-{backend}"
    local_dir.mkdir()
    rss0 = worker_rss()

    def progress(line: str) -> None:   # as it goes, so that a run that dies has printed how far it got
        print(f"  [{label(backend, forward)} {n_keys:,}] {line.strip()}", file=sys.stderr, flush=True)

    figures: dict[str, Any] = {"write_savepoint": write_load(spark, location, n_keys)}
    progress(f"write_savepoint wall {figures['write_savepoint']['wall']:.2f} s cpu "
             f"{figures['write_savepoint']['cpu']:.2f} s ({load_average()})")
    job = KeyedJob(f"scale-{backend}", "k", RunningCountSum(), output_schema=OUTPUT, max_parallelism=MAXP,
                   checkpoint_location=location, backend=backend, restore_from_savepoint="load",
                   local_dir=str(local_dir), retain=2, forward_to_warm_process=forward)
    seed = 0
    figures["first"] = timed_batch(job, events(spark, n_keys, seed), 2)
    progress(_batch("first batch (restore)", figures["first"]))
    steady = []
    for _ in range(steady_batches):
        seed += 1
        steady.append(timed_batch(job, events(spark, n_keys, seed), 2))
        progress(_batch("steady batch", steady[-1]))
    figures["steady"] = steady
    rss1 = worker_rss()
    figures["rss_per_key"] = (rss1[0] - rss0[0]) / n_keys
    figures["anon_per_key"] = (rss1[1] - rss0[1]) / n_keys
    figures["disk_per_key"] = dir_bytes(str(local_dir)) / n_keys if backend == "rocksdb" else 0.0
    progress(f"memory per key {figures['rss_per_key']:.0f} B resident ({figures['anon_per_key']:.0f} B anonymous), "
             f"{figures['disk_per_key']:.0f} B local disk")
    for name, p in (("2->3", 3), ("3->2", 2), ("2->4", 4)):
        seed += 1
        figures[name] = timed_batch(job, events(spark, n_keys, seed), p)
        progress(_batch(f"rescale {name}", figures[name]))
    shutil.rmtree(location, ignore_errors=True)
    shutil.rmtree(local_dir, ignore_errors=True)
    return figures


SPARK_FILE_KEYS = 5_000_000   # keys per Parquet file of the baseline's events (bounds the driver's memory)
SAMPLE = 1000


def spark_events(source: pathlib.Path, n_keys: int) -> tuple[Any, Any]:
    """Events holding each of the n_keys keys once (the keys keygroups loads), shuffled, as Parquet files of at most
    SPARK_FILE_KEYS rows; returns (keys, values) for the check."""
    import pyarrow.parquet as pq

    source.mkdir()
    rng = np.random.default_rng(7)
    keys = key_of(rng.permutation(n_keys).astype(np.int64))
    values = rng.integers(1, 100, n_keys, dtype=np.int64)
    for i, lo in enumerate(range(0, n_keys, SPARK_FILE_KEYS)):
        pq.write_table(pa.table({"key": keys[lo:lo + SPARK_FILE_KEYS], "value": values[lo:lo + SPARK_FILE_KEYS]}),
                       source / f"part-{i:05d}.parquet")
    return keys, values


def spark_repartition(spark: Any, n_keys: int, work: pathlib.Path, runs: int) -> dict[str, Any] | None:
    """Spark's offline repartition 2 -> 3 of a JVM transformWithState RocksDB state of n_keys keys, ``runs`` times
    (each on a fresh copy), each checked through the state data source; None where this pyspark has none."""
    if not hasattr(spark, "_streamingCheckpointManager"):
        return None
    from spark_repartition_baseline import run_spark_repartition
    from spark_tws_baseline import compare_summary, expected_summary, run_tws_jvm, state_summary

    def progress(line: str) -> None:
        print(f"  [spark {n_keys:,}] {line}", file=sys.stderr, flush=True)

    t = time.perf_counter()
    keys, values = spark_events(work / "tws-events", n_keys)
    sample = [int(k) for k in np.random.default_rng(8).choice(keys, min(SAMPLE, n_keys), replace=False)]
    expected = expected_summary(keys, values, sample)
    del keys, values
    progress(f"events written in {time.perf_counter() - t:.1f} s")
    base = work / "tws-ck"
    cpu = tree_cpu()
    built = run_tws_jvm(spark, str(work / "tws-events"), str(base), 2)
    built["cpu"] = tree_cpu() - cpu
    built["state_bytes"] = dir_bytes(str(base / "state"))
    built["load"] = load_average()
    if built["events"] != n_keys:
        raise RuntimeError(f"the baseline's query read {built['events']} events, not {n_keys}")
    progress(f"state built: wall {built['seconds']:.1f} s cpu {built['cpu']:.1f} s, {built['batches']} batch(es), "
             f"{built['state_bytes'] / 1e6:.1f} MB ({built['load']})")
    problems = compare_summary(state_summary(spark, str(base), sample), expected)
    if problems:
        raise RuntimeError(f"the baseline's state before the repartition is wrong: {problems}")
    shutil.rmtree(work / "tws-events", ignore_errors=True)
    results = []
    for i in range(runs):
        ck = work / f"tws-ck-{i}"
        shutil.copytree(base, ck)
        cpu = tree_cpu()
        figures = run_spark_repartition(spark, str(ck), 3)
        figures["cpu"] = tree_cpu() - cpu
        figures["load"] = load_average()
        t = time.perf_counter()
        problems = compare_summary(state_summary(spark, str(ck), sample), expected)
        if figures["partitions_after"] != 3:
            problems.append(f"{figures['partitions_after']} state partitions after the repartition, not 3")
        figures["state"] = "OK" if not problems else "; ".join(problems)
        progress(f"repartition {i}: wall {figures['seconds']:.2f} s cpu {figures['cpu']:.2f} s read "
                 f"{figures['bytes_read'] / 1e6:.1f} MB ({figures['records_read']:,} rows) state "
                 f"{figures['state_bytes_before'] / 1e6:.1f} -> {figures['state_bytes_after'] / 1e6:.1f} MB; "
                 f"check {figures['state']} ({time.perf_counter() - t:.1f} s) ({figures['load']})")
        if problems:
            raise RuntimeError(f"the state after Spark's repartition is wrong: {figures['state']}")
        results.append(figures)
        shutil.rmtree(ck, ignore_errors=True)
    return {"build": built, "runs": results,
            "wall": statistics.median(r["seconds"] for r in results),
            "cpu": statistics.median(r["cpu"] for r in results)}


def report_spark(n_keys: int, spark_figures: dict[str, Any] | None, keygroups: dict[str, dict[str, Any]]) -> None:
    """Spark's repartition, then every keygroups rescale batch of the same key count beside it with the ratio."""
    if spark_figures is None:
        print("  Spark's offline repartition: not in this pyspark")
        return
    b, runs = spark_figures["build"], spark_figures["runs"]
    last = runs[-1]
    print(f"  Spark (transformWithState in the JVM, one ValueState (count, sum) per key, RocksDB, 2 partitions):")
    print(f"    {'build the state':<28s} wall {b['seconds']:7.2f} s  cpu {b['cpu']:7.2f} s  ({b['events']:,} events "
          f"in {b['batches']} batch(es); state {b['state_bytes'] / 1e6:.1f} MB) [{b['load']}]")
    print(f"    {'repartition 2->3 (median)':<28s} wall {spark_figures['wall']:7.2f} s  cpu {spark_figures['cpu']:7.2f} "
          f"s  read {last['bytes_read'] / 1e6:8.1f} MB ({last['records_read']:,} rows), shuffled "
          f"{last['shuffle_bytes'] / 1e6:.1f} MB, state {last['state_bytes_before'] / 1e6:.1f} MB -> "
          f"{last['state_bytes_after'] / 1e6:.1f} MB; state {last['state']}  (of {len(runs)}: "
          + ", ".join(f"{r['seconds']:.2f}/{r['cpu']:.2f}" for r in runs) + f") [{last['load']}]")
    if not keygroups:
        return
    print(f"  side by side at {n_keys:,} keys: Spark's offline repartition 2->3 (median) / keygroups' rescale batch "
          f"(which also processes {EVENTS:,} events)")
    for backend, f in keygroups.items():
        for name in ("2->3", "3->2", "2->4"):
            r = f[name]
            print(f"    keygroups {backend:<7s} {name}  wall {r['wall']:7.2f} s  cpu {r['cpu']:7.2f} s  read "
                  f"{r['report'].bytes_restored / 1e6:8.1f} MB   Spark/keygroups: wall "
                  f"{spark_figures['wall'] / r['wall']:5.1f}x  cpu {spark_figures['cpu'] / r['cpu']:5.1f}x  bytes read "
                  f"{last['bytes_read'] / max(r['report'].bytes_restored, 1):5.1f}x")


# ---- report -------------------------------------------------------------------------------------------------------

def _batch(name: str, b: dict[str, Any], steady: dict[str, float] | None = None) -> str:
    r = b["report"]
    line = f"    {name:<28s} wall {b['wall']:7.2f} s  cpu {b['cpu']:7.2f} s"
    if steady is not None:
        line += f"  ({b['wall'] / steady['wall']:4.2f}x / {b['cpu'] / steady['cpu']:4.2f}x steady)"
    if b.get("moved_holder"):
        line += (f"  read {r.bytes_restored / 1e6:8.1f} MB of {b['moved_holder'] / 1e6:8.1f} MB that changed holder "
                 f"({r.bytes_restored / b['moved_holder']:.2f}x; {b.get('moved', 0) / 1e6:.1f} MB changed subtask "
                 f"index)")
    elif "moved" in b and b["moved"]:
        line += (f"  read {r.bytes_restored / 1e6:8.1f} MB of {b['moved'] / 1e6:8.1f} MB that changed owner "
                 f"({r.bytes_restored / b['moved']:.2f}x)")
    elif r.bytes_restored:
        line += f"  read {r.bytes_restored / 1e6:8.1f} MB"
    return line + (f"  [key groups warm {r.key_groups_warm}/caught-up {r.key_groups_caught_up}/cold "
                   f"{r.key_groups_cold}; forwarded {b.get('forwarded', 0)}/{b.get('subtasks', 0)}; {b['load']}]")


def label(backend: str, forward: bool) -> str:
    return backend if forward or backend != "heap" else "heap, not forwarded"


def report(n_keys: int, backend: str, f: dict[str, Any], forward: bool = True) -> None:
    w = f["write_savepoint"]
    steady = {k: statistics.median(b[k] for b in f["steady"]) for k in ("wall", "cpu")}
    print(f"  {label(backend, forward)}:")
    print(f"    {'load: write_savepoint':<28s} wall {w['wall']:7.2f} s  cpu {w['cpu']:7.2f} s")
    print(_batch("load: first batch (restore)", f["first"]))
    print(f"    {'memory per key':<28s} {f['rss_per_key']:.0f} B resident in the Python workers "
          f"({f['anon_per_key']:.0f} B anonymous)"
          + (f", {f['disk_per_key']:.0f} B on local disk" if backend == "rocksdb" else ""))
    print(f"    {'steady batch (median)':<28s} wall {steady['wall']:7.2f} s  cpu {steady['cpu']:7.2f} s  "
          f"(of {len(f['steady'])}: " + ", ".join(f"{b['wall']:.2f}/{b['cpu']:.2f}" for b in f["steady"]) + ")")
    for name in ("2->3", "3->2", "2->4"):
        print(_batch(f"rescale {name}", f[name], steady))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--backends", nargs="+", default=["heap", "rocksdb"], choices=["heap", "rocksdb"])
    parser.add_argument("--steady", type=int, default=3, help="steady batches (the median is printed)")
    parser.add_argument("--spark-repartition", action="store_true",
                        help="also time Spark's offline repartition of a transformWithState state of as many keys")
    parser.add_argument("--spark-only", action="store_true",
                        help="only Spark's offline repartition (implies --spark-repartition; no keygroups job)")
    parser.add_argument("--spark-runs", type=int, default=3, help="Spark repartitions timed (the median is printed)")
    parser.add_argument("--driver-memory", default="4g", help="spark.driver.memory (8g for 50M keys' baseline)")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--forward", choices=["on", "off", "both"], default="on",
                        help="heap: a task placed on a Python worker that does not hold its state runs the subtask in "
                             "the worker that does (KeyedJob(forward_to_warm_process=...)); both: off, then on")
    args = parser.parse_args(argv)
    if args.spark_only:
        args.spark_repartition = True
        args.backends = []
    classes = None
    if args.spark_repartition:
        from spark_tws_baseline import jvm_classes

        classes = [jvm_classes()]
    spark = session(args.driver_memory, classes)
    print(f"{EVENTS:,} events per batch, max parallelism {MAXP}, Spark local[2]; times wall and CPU of the process "
          f"tree; machine shared ({load_average()} at start)")
    with tempfile.TemporaryDirectory(dir=args.work_dir) as d:
        if args.backends:
            warm_up = pathlib.Path(d) / "warm-up"
            warm_up.mkdir()
            run_backend(spark, 1000, "heap", warm_up, 1)   # JVM, Python workers, imports
        for n_keys in args.keys:
            print(f"\n{n_keys:,} keys", flush=True)
            keygroups = {}
            for backend in args.backends:
                forwards = {"on": [True], "off": [False], "both": [False, True]}[args.forward]
                for forward in forwards if backend == "heap" else [True]:
                    work = pathlib.Path(d) / f"{backend}-{n_keys}-{forward}"
                    work.mkdir()
                    keygroups[backend] = run_backend(spark, n_keys, backend, work, args.steady, forward)
                    report(n_keys, backend, keygroups[backend], forward)
                    shutil.rmtree(work, ignore_errors=True)
            if args.spark_repartition:
                work = pathlib.Path(d) / f"spark-{n_keys}"
                work.mkdir()
                report_spark(n_keys, spark_repartition(spark, n_keys, work, args.spark_runs), keygroups)
                shutil.rmtree(work, ignore_errors=True)
            sys.stdout.flush()
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
