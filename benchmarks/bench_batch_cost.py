"""What a micro-batch costs against the size of the state it runs on (issue 11: "a micro-batch costs what it touches").

One Spark session (local[2]), a per-key counter (a ValueState int64 updated in ``process_key_batch``), per backend two
jobs: one whose state holds ``--small`` keys (10k) and one whose state holds ``--big`` keys (1M). Each is first loaded
by one untimed batch; then the SAME ``--batch-keys``-key micro-batches (drawn from the keys both states hold, so a batch
touches all of the small state and ~1% of the big one) run on the small and the big job in turn, ``--rounds`` rounds
after one untimed warm-up round. Printed per backend: the median batch time on each state, the ratio big/small, and the
bytes each batch's checkpoint newly wrote against the bytes it references (the full state), beside issue 11's targets;
per batch, where the time goes (restore / prepare / process / snapshot of the slowest subtask, from the batch's
reports; "other" is the rest of the batch's wall time: Spark's scheduling, shuffle and Python workers) and how each
subtask got its state (warm, caught-up, cold; counted per job at the end), and at the end the peak resident memory of
the whole process tree (driver, JVM, Python workers).

    python benchmarks/bench_batch_cost.py                                   # heap and rocksdb, 10k vs 1M keys
    python benchmarks/bench_batch_cost.py --backends heap --big 10000000    # heap at 10M keys (slow before issue 11)
    python benchmarks/bench_batch_cost.py --rounds 3 --big 200000           # a quick look

Batch times are wall clock on the driver around the one call that runs a batch (Spark scheduling included). The
counts of the last batch of every job are checked against the expected counts before any figure is printed.
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from keygroups.checkpoint import CheckpointMetadata
from keygroups.runtime import KeyedProcessFunction
from keygroups.serializers import Int64Serializer
from keygroups.state import ValueStateDescriptor

PARALLELISM = 2
MAX_PARALLELISM = 128
PHASES = ("restore", "prepare", "process", "snapshot")  # a subtask's timings in its report
COLUMNS = (*PHASES, "other")
OUTPUT = pa.schema([("key", pa.int64()), ("count", pa.int64())])
COUNT = ValueStateDescriptor("count", Int64Serializer())
#: issue 11's targets: big/small batch time at 1M keys (at 10M keys), and the bytes a 1%-touching batch adds.
RATIO_TARGET, RATIO_TARGET_10M, ADDED_BYTES_TARGET = 1.5, 2.0, 0.05
#: keys per load task: the load batch runs at a parallelism that keeps each task's share near this.
LOAD_KEYS_PER_TASK = 500_000


class CountPerKey(KeyedProcessFunction):
    """Per key, the number of records seen so far: one state read and one update per key and batch."""

    def open(self, context):
        self.count = context.get_state(COUNT)

    def process_key_batch(self, key, records, context):
        count = (self.count.value() or 0) + records.num_rows
        self.count.update(count)
        return [(key, count)]


# ---- the two calls the driver's API change touches --------------------------------------------------------------

def new_job(name: str, location: str, backend: str) -> Any:
    """The counter job on ``backend`` with its checkpoints under ``location``."""
    from keygroups.spark import KeyedJob

    return KeyedJob(name, "key", CountPerKey(), output_schema=OUTPUT, max_parallelism=MAX_PARALLELISM,
                    checkpoint_location=location, backend=backend)


def run_batch(job: Any, df: Any, parallelism: int) -> Any:
    """One micro-batch of ``df`` through ``job``; returns its BatchResult."""
    return job.run_batch(df, parallelism=parallelism)


# ---- byte accounting ----------------------------------------------------------------------------------------------

def referenced_files(metadata: CheckpointMetadata, location: str) -> dict[str, int]:
    """Every state file the checkpoint references, with its size: the handle's size from the metadata, or the
    file's size on disk for a file no handle gives a size for."""
    sizes = {h.file: int(h.size) for h in metadata.keyed_handles}
    sizes.update({h["file"]: int(h["size"]) for h in metadata.operator_handles if "size" in h})
    return {f: sizes[f] if f in sizes else os.path.getsize(os.path.join(location, f)) for f in metadata.files()}


def written_on_disk(location: str, checkpoint_id: int) -> int:
    """Bytes of state files the batch of checkpoint ``checkpoint_id`` wrote, by what is on disk: its keyed files in
    ``shared/`` (named ``<prefix>-<checkpoint id>-<uuid>``) and its operator files in ``chk-<id>/`` (not _metadata,
    not the batch's output)."""
    root = pathlib.Path(location)
    directory = root / f"chk-{checkpoint_id}"
    own = sum(p.stat().st_size for p in directory.iterdir()
              if p.is_file() and p.name != "_metadata" and not p.name.startswith("output-"))
    shared = root / "shared"
    mine = [p for p in shared.iterdir() if p.name.rsplit("-", 2)[1] == str(checkpoint_id)] if shared.is_dir() else []
    return own + sum(p.stat().st_size for p in mine)


@dataclass
class Job:
    """One job of the benchmark and the state files its earlier checkpoints referenced."""

    label: str
    keys: int
    location: str
    job: Any
    seen_files: set[str] = field(default_factory=set)
    batches: list[dict[str, Any]] = field(default_factory=list)
    touched: np.ndarray | None = None  # records per key over the timed and warm-up batches


def account(job: Job, result: Any) -> tuple[int, int]:
    """(bytes this checkpoint newly wrote, bytes it references): a file no earlier checkpoint of this job referenced
    is new (state file names are unique), the others were written before and are shared."""
    files = referenced_files(result.metadata, job.location)
    new = sum(size for f, size in files.items() if f not in job.seen_files)
    job.seen_files.update(files)
    return new, sum(files.values())


# ---- memory ---------------------------------------------------------------------------------------------------------

class TreeMemory:
    """Samples the resident memory of this process and all its descendants (the JVM, Spark's Python workers)."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.peak_total = 0
        self.peak_process = (0, "")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(entry))
        tree, todo = [], [os.getpid()]
        while todo:
            pid = todo.pop()
            tree.append(pid)
            todo.extend(children.get(pid, []))
        return tree

    def sample(self) -> None:
        total = 0
        for pid in self._tree():
            try:
                with open(f"/proc/{pid}/statm") as f:
                    rss = int(f.read().split()[1]) * self._page
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
            total += rss
            if rss > self.peak_process[0]:
                self.peak_process = (rss, "java (Spark JVM)" if "java" in cmd.split(" ")[0] else cmd[:60])
        self.peak_total = max(self.peak_total, total)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def __enter__(self) -> TreeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


# ---- the run ------------------------------------------------------------------------------------------------------

def build_session(master: str) -> Any:
    """The tests' session settings (conftest): local, 2 cores, Arrow on, UI off."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(master)
        .appName("keygroups-bench-batch-cost")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.default.parallelism", "4")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.driver.memory", "2g")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def load(spark: Any, job: Job) -> float:
    """One untimed batch that gives every key 0..keys-1 one record; returns its seconds."""
    from pyspark.sql import functions as F

    tasks = max(PARALLELISM, -(-job.keys // LOAD_KEYS_PER_TASK))
    df = spark.range(0, job.keys, numPartitions=tasks).select(F.col("id").alias("key"))
    start = time.perf_counter()
    result = run_batch(job.job, df, tasks)
    seconds = time.perf_counter() - start
    new, total = account(job, result)
    print(f"  loaded {job.keys:,} keys at parallelism {tasks} in {seconds:.1f} s, "
          f"state {total / 1e6:.1f} MB ({total / job.keys:.1f} B/key)", flush=True)
    job.touched = np.ones(job.keys, dtype=np.int64)
    return seconds


def timed_batch(spark: Any, job: Job, df: Any, keys: np.ndarray, round_no: int, warmup: bool) -> None:
    start = time.perf_counter()
    result = run_batch(job.job, df, PARALLELISM)
    wall = time.perf_counter() - start
    new, total = account(job, result)
    on_disk = written_on_disk(job.location, result.checkpoint_id)
    if on_disk != new:
        print(f"  ! {job.label} chk-{result.checkpoint_id}: {on_disk:,} bytes of state files on disk but the "
              f"metadata accounts {new:,} as new: update referenced_files() for the current handle format")
    phases = {p: max(getattr(r.seconds, p) for r in result.reports) for p in PHASES}
    # what the slowest subtask's phases leave unexplained: Spark's scheduling, shuffle and Python workers
    phases["other"] = wall - max(sum(getattr(r.seconds, p) for p in PHASES) for r in result.reports)
    job.touched[keys] += 1
    modes = [r.restored.mode for r in result.reports]  # warm / caught-up / cold, per subtask
    row = {"round": round_no, "warmup": warmup, "wall": wall, "new": new, "total": total, "disk": on_disk,
           "restored": sum(result.restored_bytes), "records": result.records_in, "result": result, "modes": modes,
           **phases}
    job.batches.append(row)
    mark = "warm-up" if warmup else f"round {round_no}"
    print(f"  {mark:<9} {job.label:<14} {wall:>7.2f} s | " + " ".join(f"{p} {phases[p]:>5.2f}" for p in COLUMNS)
          + f" | restored {row['restored'] / 1e6:>6.1f} MB ({', '.join(modes)}), wrote {new / 1e6:>6.1f} of "
          f"{total / 1e6:>6.1f} MB ({new / total:>6.1%})", flush=True)


def check_counts(job: Job) -> None:
    """The last batch's output: every key's count is its load record plus one per batch that held it."""
    out = job.batches[-1]["result"].output.toPandas()
    expected = job.touched[out["key"].to_numpy()]
    wrong = int((out["count"].to_numpy() != expected).sum())
    if wrong:
        raise SystemExit(f"{job.label}: {wrong} of {len(out)} keys have a wrong count in the last batch's output")


def median(job: Job, name: str) -> float:
    return statistics.median(b[name] for b in job.batches if not b["warmup"])


def summary(backend: str, small: Job, big: Job, batch_keys: int) -> None:
    s, b = median(small, "wall"), median(big, "wall")
    ratio = b / s
    target = RATIO_TARGET_10M if big.keys >= 10_000_000 else RATIO_TARGET
    share = max(r["new"] / r["total"] for r in big.batches if not r["warmup"])
    touched = batch_keys / big.keys
    rounds = sum(not r["warmup"] for r in big.batches)
    print(f"\n== {backend}: the same {batch_keys:,}-key batches on a {small.keys:,}-key and a {big.keys:,}-key state, "
          f"parallelism {PARALLELISM}, max parallelism {MAX_PARALLELISM}, medians of {rounds} rounds")
    print(f"{'state':<16}{'batch s':>9}" + "".join(f"{c:>9}" for c in COLUMNS) +
          f"{'restored MB':>13}{'new MB':>9}{'state MB':>10}{'new/state':>11}")
    print("  (phases: the slowest subtask's seconds; other: the batch's seconds outside its slowest subtask)")
    for job in (small, big):
        print(f"{job.label:<16}{median(job, 'wall'):>9.2f}" + "".join(f"{median(job, c):>9.2f}" for c in COLUMNS)
              + f"{median(job, 'restored') / 1e6:>13.1f}{median(job, 'new') / 1e6:>9.1f}"
              f"{median(job, 'total') / 1e6:>10.1f}{median(job, 'new') / median(job, 'total'):>11.1%}")
    for job in (small, big):
        counts = collections.Counter(m for b in job.batches if not b["warmup"] for m in b["modes"])
        print(f"{job.label:<16}subtask restores: " + ", ".join(f"{n} {mode}" for mode, n in sorted(counts.items())))
    verdict = "meets" if ratio <= target else "misses"
    print(f"ratio big/small {ratio:.2f}x   target <= {target:.1f}x at {big.keys:,} keys: {verdict}")
    verdict = "meets" if share <= ADDED_BYTES_TARGET else "misses"
    print(f"a batch touching {touched:.1%} of the big state adds up to {share:.1%} of its bytes   "
          f"target <= {ADDED_BYTES_TARGET:.0%}: {verdict}")


def run_backend(spark: Any, backend: str, args: argparse.Namespace, work: pathlib.Path) -> None:
    print(f"\n-- {backend}", flush=True)
    jobs = []
    for keys in (args.small, args.big):
        location = str(work / f"{backend}-{keys}")
        label = f"{keys:,} keys"
        jobs.append(Job(label, keys, location, new_job(f"counter-{backend}-{keys}", location, backend)))
        load(spark, jobs[-1])
    small, big = jobs
    rng = np.random.default_rng(11)
    for round_no in range(args.warmup + args.rounds):
        keys = np.sort(rng.choice(args.small, size=args.batch_keys, replace=False))
        df = spark.createDataFrame(pd.DataFrame({"key": keys.astype(np.int64)}))
        order = (small, big) if round_no % 2 == 0 else (big, small)  # alternate which goes first: drift hits both
        for job in order:
            timed_batch(spark, job, df, keys, round_no - args.warmup + 1, round_no < args.warmup)
    for job in jobs:
        check_counts(job)
    summary(backend, small, big, args.batch_keys)
    for job in jobs:
        shutil.rmtree(job.location, ignore_errors=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds (each: one batch per state)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--batch-keys", type=int, default=10_000, help="distinct keys per micro-batch")
    parser.add_argument("--small", type=int, default=10_000, help="keys in the small state")
    parser.add_argument("--big", type=int, default=1_000_000, help="keys in the big state (10000000: heap at 10M)")
    parser.add_argument("--backends", nargs="+", default=["heap", "rocksdb"], choices=["heap", "rocksdb"])
    parser.add_argument("--master", default="local[2,2]")
    args = parser.parse_args(argv)
    if not 0 < args.batch_keys <= args.small <= args.big:
        parser.error(f"need 0 < --batch-keys <= --small <= --big, got {args.batch_keys}, {args.small}, {args.big}: "
                     "a batch's keys are drawn from the keys both states hold")

    started = time.perf_counter()
    work = pathlib.Path(tempfile.mkdtemp(prefix="kg-bench-batch-cost-"))
    with TreeMemory() as memory:
        spark = build_session(args.master)
        try:
            for backend in args.backends:
                run_backend(spark, backend, args, work)
                memory.sample()
        finally:
            spark.stop()
            shutil.rmtree(work, ignore_errors=True)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"\npeak resident memory: {memory.peak_total / 1e6:,.0f} MB for the whole process tree (sampled every "
          f"{memory.interval} s), largest single process {memory.peak_process[0] / 1e6:,.0f} MB "
          f"({memory.peak_process[1]}); the driver's Python {rss_mb:,.0f} MB; run {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
