"""Rescaling at production size (issue 34): load, steady batches and rescale batches of a keyed job with 1M-50M keys,
on both backends, on Spark local[2], beside Spark's own offline repartition of a transformWithState RocksDB state.

    python benchmarks/bench_rescale_scale.py                                  # 1M keys, both backends
    python benchmarks/bench_rescale_scale.py --keys 1000000 10000000 50000000
    python benchmarks/bench_rescale_scale.py --keys 1000000 --spark-repartition   # + Spark's offline repartition

Per key count and backend, one job (a running count and sum per key: two int64 ValueStates, one output row per
event; max parallelism 128):

* **load**: the state of every key written as a savepoint by ``keygroups.spark.write_savepoint`` from
  ``spark.range`` (generated in Spark, in bulk), then the job's first batch at p=2, which restores that savepoint
  cold and writes its first checkpoint (full: a savepoint's files are not shared with checkpoints);
* **memory per key**: heap, the resident growth of Spark's Python workers (which keep the heap backends warm) over
  the key count; RocksDB, the bytes of its databases on local disk, and the workers' resident growth;
* **steady**: a batch of 100k events (keys drawn uniformly) at p=2, warm, median of ``--steady`` batches;
* **rescale**: the 2 -> 3, 3 -> 2 and 2 -> 4 batches (100k events each): time, bytes read (``bytes_restored``)
  against the bytes of the key groups that changed holder (the batch's assignment decision: a subtask takes over
  the warm state of the previous range it shares most with, so a key group moves when its holder changes), beside
  those whose subtask index changes (each key group's chain in the checkpoint restored from), and the batch's cost
  against the steady one.

Times: wall, and CPU of the whole process tree (driver, JVM, Python workers; from /proc), since the work runs in
Spark's worker processes. The machine is shared: the load average is printed with every figure.

Spark's baseline (``--spark-repartition``, pyspark 4.2+): a transformWithStateInPandas query (RocksDB state
provider, 2 shuffle partitions) builds a running (count, sum) per key for the same key count, then
``spark._streamingCheckpointManager.repartition(checkpoint, 3)`` rewrites all of its state offline
(spark_repartition_baseline.run_spark_repartition): its wall time, bytes read and state bytes beside keygroups'
2 -> 3 batch.
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

def session() -> Any:
    from pyspark.sql import SparkSession

    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    spark = (SparkSession.builder.master("local[2]").appName("bench-rescale-scale")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.memory", "4g").config("spark.sql.shuffle.partitions", "4")
             .config("spark.sql.execution.arrow.pyspark.enabled", "true")
             .config("spark.sql.session.timeZone", "UTC").getOrCreate())
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
           "load": load_average()}
    if before is not None:
        out["moved"] = moved_bytes(before, before.parallelism, parallelism)
    decision = result.report.assignment
    if decision is not None and decision.previous is not None:   # the warm takeover's: what changed holder
        out["moved_holder"] = decision.moved_bytes
    return out


def run_backend(spark: Any, n_keys: int, backend: str, work: pathlib.Path, steady_batches: int) -> dict[str, Any]:
    from keygroups.spark import KeyedJob

    location = str(work / f"ck-{backend}")
    local_dir = work / f"local-{backend}"
    local_dir.mkdir()
    rss0 = worker_rss()

    def progress(line: str) -> None:   # as it goes, so that a run that dies has printed how far it got
        print(f"  [{backend} {n_keys:,}] {line.strip()}", file=sys.stderr, flush=True)

    figures: dict[str, Any] = {"write_savepoint": write_load(spark, location, n_keys)}
    progress(f"write_savepoint wall {figures['write_savepoint']['wall']:.2f} s cpu "
             f"{figures['write_savepoint']['cpu']:.2f} s ({load_average()})")
    job = KeyedJob(f"scale-{backend}", "k", RunningCountSum(), output_schema=OUTPUT, max_parallelism=MAXP,
                   checkpoint_location=location, backend=backend, restore_from_savepoint="load",
                   local_dir=str(local_dir), retain=2)
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


def spark_repartition(spark: Any, n_keys: int, work: pathlib.Path) -> dict[str, Any] | None:
    if not hasattr(spark, "_streamingCheckpointManager"):
        return None
    import pyarrow.parquet as pq
    from spark_repartition_baseline import run_spark_repartition
    from spark_tws_baseline import run_tws

    source = work / "tws-events"
    source.mkdir()
    rng = np.random.default_rng(7)
    ids = rng.permutation(n_keys).astype(np.int64)   # every key once: a state of n_keys keys
    pq.write_table(pa.table({"key": key_of(ids), "value": rng.integers(1, 100, n_keys, dtype=np.int64),
                             "ts": pa.array(np.zeros(n_keys, dtype=np.int64)).cast(pa.timestamp("us"))}),
                   source / "part-00000.parquet")
    ck = work / "tws-ck"
    built = run_tws(spark, str(source), str(ck), 2)
    cpu = tree_cpu()
    figures = run_spark_repartition(spark, str(ck), 3)
    figures["cpu"] = tree_cpu() - cpu
    figures["build_seconds"] = built["seconds"]
    figures["load"] = load_average()
    return figures


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
                   f"{r.key_groups_cold}; {b['load']}]")


def report(n_keys: int, backend: str, f: dict[str, Any]) -> None:
    w = f["write_savepoint"]
    steady = {k: statistics.median(b[k] for b in f["steady"]) for k in ("wall", "cpu")}
    print(f"  {backend}:")
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
    parser.add_argument("--work-dir", default=None)
    args = parser.parse_args(argv)
    spark = session()
    print(f"{EVENTS:,} events per batch, max parallelism {MAXP}, Spark local[2]; times wall and CPU of the process "
          f"tree; machine shared ({load_average()} at start)")
    with tempfile.TemporaryDirectory(dir=args.work_dir) as d:
        warm_up = pathlib.Path(d) / "warm-up"
        warm_up.mkdir()
        run_backend(spark, 1000, "heap", warm_up, 1)   # JVM, Python workers, imports
        for n_keys in args.keys:
            print(f"\n{n_keys:,} keys")
            for backend in args.backends:
                work = pathlib.Path(d) / f"{backend}-{n_keys}"
                work.mkdir()
                report(n_keys, backend, run_backend(spark, n_keys, backend, work, args.steady))
                shutil.rmtree(work, ignore_errors=True)
            if args.spark_repartition:
                work = pathlib.Path(d) / f"spark-{n_keys}"
                work.mkdir()
                figures = spark_repartition(spark, n_keys, work)
                if figures is None:
                    print("  Spark's offline repartition: not in this pyspark")
                else:
                    print(f"  Spark repartition 2 -> 3 (transformWithState, RocksDB): wall {figures['seconds']:.2f} s"
                          f"  cpu {figures['cpu']:.2f} s  read {figures['bytes_read'] / 1e6:.1f} MB, state "
                          f"{figures['state_bytes_before'] / 1e6:.1f} MB -> {figures['state_bytes_after'] / 1e6:.1f} "
                          f"MB (built in {figures['build_seconds']:.1f} s) [{figures['load']}]")
                shutil.rmtree(work, ignore_errors=True)
    spark.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
