"""Warm RocksDB batches against the heap's (issue 34, item 3) and RocksDB's per-key cost against its own point lookup
(issue 33, item 3), in one process, CPU time beside wall:

    python benchmarks/bench_rocksdb_warm.py                       # 600k events over 50k keys, 6 batches, 3 rounds
    python benchmarks/bench_rocksdb_warm.py --events 2000000 --keys 100000 --files 10

1. **Warm batches**: issue 33's peer job (``_jobs.RunningCountSum``: a running count and sum per key, two int64
   ValueStates, one output row per record) through ``KeyedFunctionHarness`` (p=2, max parallelism 128) on each
   backend, over the same ``_events`` log (``--files`` batches, one checkpoint each). The first batch starts from
   nothing; every later one is warm (heap: the backends kept in the process; RocksDB: the databases kept on local
   disk, reopened, and the decoded values this process kept beside them; the database written at most every
   ``write_back_batches`` snapshots, the backend's default unless ``--write-back`` says). The same runs without
   write-back (``write_back_batches=1``: the database written at every snapshot) are printed beside. Figures: per
   run, the median and the mean per-batch process CPU (and the median wall) of the warm batches (the mean counts the
   batches that write the database back), the runs interleaved, medians over ``--rounds`` rounds; the ratios to the
   heap against the target 1.3, and the 90th-percentile batch (p90).
2. **Per key**: a backend restored from a 400k-key savepoint (two int64 ValueStates, written by the bulk savepoint
   writer), then batches of ``--batch-keys`` distinct keys: RocksDB's own point lookup through rocksdict (``db.get``
   per key, the database keys built beforehand) of the same keys for both states, against the backend's read of
   the batch (``prefetch``: database keys built and sorted, one multi-get per state, decoded into the cache) and
   against its whole cycle per key (the read, then each state's ``value()`` and ``update()`` per key through the
   compiled loop's path, then the flush: keys and values encoded in C, one WriteBatch); medians of 4 batches
   after one warm-up. Then the declarative aggregates' state I/O on RocksDB: ``get_values`` and ``put_values`` of a
   batch's keys in bulk (one multi-get, the cache read and written in C) against the generic key-by-key loop
   (``set_current_key``, ``value()``, ``update()`` per key), each from an empty cache, the flush included.

``--phases`` splits the warm batches' CPU (both backends, same runs): the main thread, the other Python threads
(snapshot workers; the process's CPU less the rest), RocksDB's own threads (``rocksdb:*`` in ``/proc/self/task``:
compactions and memtable flushes), and, for RocksDB, the backend's phases in thread CPU, each without the phases it
calls (open, restore, prefetch, flush encoding, writing to the database, delta capture, the full key groups encoded
from the caches, the snapshot file, dispose).

The machine is shared: the load average is printed with every figure.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import threading
import pathlib
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _events import event_files, generate_events  # noqa: E402
from _jobs import COUNT_SUM_OUTPUT, RunningCountSum  # noqa: E402

from keygroups import assign_key_groups, key_group_range  # noqa: E402
from keygroups.serializers import Int64Serializer  # noqa: E402
from keygroups.state import RocksDBKeyedStateBackend, ValueStateDescriptor  # noqa: E402
from keygroups.state._base import KeyedStateBackendBase  # noqa: E402
from keygroups.testing import KeyedFunctionHarness  # noqa: E402

from bench_rocksdb_restore import cpu, load, point_and_prefetch, write_state  # noqa: E402

MAXP = 128

#: The RocksDB backend's phases ``--phases`` times: (label, module attribute holding the function, its name).
_PHASES = [("open", "RocksDBKeyedStateBackend", "_open_at"), ("restore", "RocksDBKeyedStateBackend", "_restore"),
           ("prefetch", "RocksDBKeyedStateBackend", "prefetch"),
           ("flush: encoding", "RocksDBKeyedStateBackend", "_flush"),
           ("flush: SST written, ingested", "RocksDBKeyedStateBackend", "_ingest_rows"),
           ("flush: WriteBatch written", "RocksDBKeyedStateBackend", "_write"),
           ("delta capture", "RocksDBKeyedStateBackend", "_capture_deltas"),
           # a deferred snapshot's own delta, encoded in the batches that do not write the database (not a re-encoding
           # at the write-back, which encodes its rows under "flush: encoding" and "write-back: unwritten keys")
           ("deferred snapshot: its delta encoded", "RocksDBKeyedStateBackend", "_encode_deferred"),
           ("write-back: unwritten keys encoded", "RocksDBKeyedStateBackend", "_unwritten_runs"),
           ("snapshot: full key groups from the caches", "RocksDBKeyedStateBackend", "_full_from_caches"),
           ("snapshot file (worker)", None, "write_keyed_snapshot"),
           ("dispose (close, seal)", "RocksDBKeyedStateBackend", "dispose")]


class PhaseClock:
    """Thread CPU per phase of the RocksDB backend, each phase without the phases it calls (a stack per thread), and
    per batch the CPU of the process's threads by kind: main, RocksDB's own (``rocksdb:*``), the other (snapshot
    workers, which end before the batch does: the process's CPU less the two others)."""

    def __init__(self) -> None:
        self.phases: collections.defaultdict[str, float] = collections.defaultdict(float)
        self.threads: collections.defaultdict[str, float] = collections.defaultdict(float)
        self._local = threading.local()
        self._undo: list[tuple[Any, str, Any]] = []
        self._tick = os.sysconf("SC_CLK_TCK")

    def install(self) -> None:
        import keygroups.state.rocksdb as rocksdb_module
        for label, owner_name, name in _PHASES:
            owner = getattr(rocksdb_module, owner_name) if owner_name else rocksdb_module
            original = getattr(owner, name)
            setattr(owner, name, self._timed(label, original))
            self._undo.append((owner, name, original))

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    def _timed(self, label: str, f: Any) -> Any:
        local, phases = self._local, self.phases

        @functools.wraps(f)
        def timed(*args: Any, **kwargs: Any) -> Any:
            stack = local.__dict__.setdefault("stack", [])
            stack.append(0.0)   # CPU of the phases this one calls
            start = time.thread_time()
            try:
                return f(*args, **kwargs)
            finally:
                spent = time.thread_time() - start
                inner = stack.pop()
                phases[label] += spent - inner
                if stack:
                    stack[-1] += spent
        return timed

    def rocksdb_threads(self) -> float:
        """CPU so far of RocksDB's own threads (long-lived: one pool per process)."""
        total = 0.0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/comm") as f:
                    if not f.read().startswith("rocksdb"):
                        continue
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / self._tick
        return total

    def batch(self, run: Any) -> tuple[float, float]:
        """Run one batch (``run()``), adding its threads' CPU by kind; (process CPU, wall) of the batch."""
        c0, w0, m0, r0 = cpu(), time.perf_counter(), time.thread_time(), self.rocksdb_threads()
        run()
        c, w, m, r = cpu() - c0, time.perf_counter() - w0, time.thread_time() - m0, self.rocksdb_threads() - r0
        self.threads["main thread"] += m
        self.threads["RocksDB's threads"] += r
        self.threads["other threads (snapshot workers)"] += c - m - r
        return c, w


def _p90(values: list[float]) -> float:
    """The 90th percentile of ``values`` (linear interpolation between the closest ranks)."""
    xs = sorted(values)
    at = 0.9 * (len(xs) - 1)
    lo = int(at)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (at - lo)


def warm_batches(backend: str, tables: list[Any], clock: PhaseClock | None = None,
                 write_back: int | None = None) -> list[tuple[float, float]]:
    """(CPU s, wall s) of each warm batch (all but the first) of the peer job on ``backend``; ``clock`` (from the
    second batch on) adds their CPU by thread and phase. ``write_back``: RocksDB's ``write_back_batches`` (its
    default: None)."""
    import keygroups.state.rocksdb as rocksdb_module
    default = rocksdb_module.DEFAULT_WRITE_BACK_BATCHES
    if write_back is not None:
        rocksdb_module.DEFAULT_WRITE_BACK_BATCHES = write_back
    try:
        return _warm_batches(backend, tables, clock)
    finally:
        rocksdb_module.DEFAULT_WRITE_BACK_BATCHES = default


def _warm_batches(backend: str, tables: list[Any], clock: PhaseClock | None) -> list[tuple[float, float]]:
    per = []
    with KeyedFunctionHarness(RunningCountSum(), "key", output_schema=COUNT_SUM_OUTPUT, max_parallelism=MAXP,
                              parallelism=2, backend=backend) as h:
        for i, table in enumerate(tables):
            def run(table: Any = table) -> None:
                h.process(table)
                h.output_table()
            if clock is not None and i > 0:
                per.append(clock.batch(run))
                continue
            c0, w0 = cpu(), time.perf_counter()
            run()
            per.append((cpu() - c0, time.perf_counter() - w0))
    return per[1:]


def per_key(n_keys: int, batch_keys: int, batches: int) -> None:
    with tempfile.TemporaryDirectory() as work:
        storage, metadata, keys, _ = write_state(os.path.join(work, "state"), n_keys)
        b = RocksDBKeyedStateBackend(key_group_range(MAXP, 1, 0), MAXP, Int64Serializer())
        try:
            b.restore(storage, metadata)
            count = b.get_state(ValueStateDescriptor("count", Int64Serializer()))
            total = b.get_state(ValueStateDescriptor("sum", Int64Serializer()))
            rng = np.random.default_rng(1)
            point, reads, cycle = [], [], []
            set_key = b.set_current_key
            for _ in range(batches + 1):
                batch = np.unique(rng.choice(keys, batch_keys))
                groups = np.asarray(assign_key_groups(batch, MAXP))
                listed = batch.tolist()
                p, r = point_and_prefetch(b, batch)
                point.append(p)
                reads.append(r)
                b._flush(evict=True)
                c0 = cpu()
                b.prefetch(listed, groups)
                for k in listed:
                    set_key(k)
                    count.update((count.value() or 0) + 1)
                    total.update((total.value() or 0) + k)
                b._flush(evict=True)
                cycle.append((cpu() - c0) / len(listed))
            # the declarative aggregates' bulk reads and writes against the generic key-by-key loop, same keys
            bulk: list[float] = []
            looped: list[float] = []
            for _ in range(batches + 1):
                batch = np.unique(rng.choice(keys, batch_keys))
                listed = batch.tolist()
                for out, get, put in ((bulk, b.get_values, b.put_values),
                                      (looped, functools.partial(KeyedStateBackendBase.get_values, b),
                                       functools.partial(KeyedStateBackendBase.put_values, b))):
                    b._flush(evict=True)
                    c0 = cpu()
                    values = get("count", listed)
                    put("count", listed, [(v or 0) + 1 for v in values])
                    b._flush()
                    out.append((cpu() - c0) / len(listed))
            p, r, c = (statistics.median(x[1:]) for x in (point, reads, cycle))
            bk, lp = statistics.median(bulk[1:]), statistics.median(looped[1:])
            print(f"\n== per key: {n_keys:,}-key state, batches of {len(listed):,} distinct keys, two int64 states, "
                  f"medians of {batches} ({load()})")
            print(f"  RocksDB's point lookup (rocksdict db.get per key, both states)          {1e9 * p:7.0f} ns per key")
            print(f"  backend read of the batch (prefetch: keys built, multi-get, decoded)   {1e9 * r:7.0f} ns per key"
                  f"   = {r / p:.2f}x the point lookups   target <= 1.5 {'meets' if r / p <= 1.5 else 'misses'}")
            print(f"  backend whole cycle (read, value+update of both states, flush)          {1e9 * c:7.0f} ns per key"
                  f"   = {c / p:.2f}x the point lookups (for the record: it also writes)")
            print(f"  declarative state I/O, one state (get_values, put_values, flush): bulk {1e9 * bk:5.0f} ns per key,"
                  f" key by key {1e9 * lp:5.0f} ns per key ({lp / bk:.2f}x)")
        finally:
            b.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=600_000)
    parser.add_argument("--keys", type=int, default=50_000)
    parser.add_argument("--files", type=int, default=6, help="batches (the first one is not warm)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--state-keys", type=int, default=400_000, help="keys of the per-key part's state")
    parser.add_argument("--batch-keys", type=int, default=100_000)
    parser.add_argument("--skip-per-key", action="store_true")
    parser.add_argument("--skip-warm", action="store_true")
    parser.add_argument("--write-back", type=int, default=None,
                        help="RocksDB's write_back_batches (default: the backend's default); the same runs without "
                             "write-back (1) are printed beside")
    parser.add_argument("--phases", action="store_true",
                        help="split the warm batches' CPU by thread and by the RocksDB backend's phases")
    args = parser.parse_args(argv)
    print(f"one process, CPU time of the process (RocksDB's own threads included); machine shared ({load()})")
    if not args.skip_warm:
        warm_part(args)
    if not args.skip_per_key:
        per_key(args.state_keys, args.batch_keys, 4)
    return 0


def warm_part(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as work:
        generate_events(pathlib.Path(work) / "events", args.events, args.keys, args.files)
        tables = [pq.read_table(f, columns=["key", "value", "ts"]) for f in event_files(pathlib.Path(work) / "events")]
        # per run: the warm batches' (CPU, wall); "rocksdb, no write-back" writes the database at every snapshot
        names = ("heap", "rocksdb", "rocksdb, no write-back")
        runs: dict[str, list[list[tuple[float, float]]]] = {b: [] for b in names}
        clocks = {b: PhaseClock() for b in ("heap", "rocksdb")} if args.phases else {}
        for r in range(args.rounds):
            for name in (names if r % 2 == 0 else names[::-1]):
                backend = "heap" if name == "heap" else "rocksdb"
                clock = clocks.get(name)
                if clock is not None and name == "rocksdb":
                    clock.install()
                try:
                    runs[name].append(warm_batches(backend, tables, clock,
                                                   1 if name == "rocksdb, no write-back" else args.write_back))
                finally:
                    if clock is not None and name == "rocksdb":
                        clock.uninstall()
                per = runs[name][-1]
                print(f"  round {r + 1}: {name:<24s} warm batch median {statistics.median(c for c, _ in per):6.3f} "
                      f"mean {statistics.fmean(c for c, _ in per):6.3f} p90 {_p90([c for c, _ in per]):6.3f} s CPU, "
                      f"median {statistics.median(w for _, w in per):6.3f} s wall ({load()}); per batch ms: "
                      + " ".join(f"{1e3 * c:.0f}" for c, _ in per), flush=True)
    # per backend, medians over rounds of: each round's median warm batch, its mean warm batch (CPU), median wall
    fig = {b: (statistics.median(statistics.median(c for c, _ in per) for per in runs[b]),
               statistics.median(statistics.fmean(c for c, _ in per) for per in runs[b]),
               statistics.median(statistics.median(w for _, w in per) for per in runs[b]),
               statistics.median(_p90([c for c, _ in per]) for per in runs[b])) for b in names}
    per_batch = args.events // args.files
    print(f"\n== warm batches: the peer job, {per_batch:,} events per batch over {args.keys:,} keys, p=2, max p "
          f"{MAXP}; {args.files - 1} warm batches per run, medians of {args.rounds} rounds ({load()})")
    hc, hm, hw, hp = fig["heap"]
    for name in names:
        c, m, w, p = fig[name]
        print(f"  {name:<24s} median batch {c:6.3f} s CPU, mean batch {m:6.3f} s CPU, p90 batch {p:6.3f} s CPU, "
              f"median {w:6.3f} s wall ({1e6 * m / per_batch:.2f} CPU us/event)" + ("" if name == "heap" else
              f"   / heap: {c / hc:.2f}x (median), {m / hm:.2f}x (mean), {p / hp:.2f}x (p90) CPU, "
              f"{w / hw:.2f}x wall"))
    rc, rm, _, _ = fig["rocksdb"]
    print(f"  rocksdb / heap target <= 1.3 (CPU): median batch {'meets' if rc / hc <= 1.3 else 'misses'}, mean "
          f"batch (write-backs included) {'meets' if rm / hm <= 1.3 else 'misses'}")
    if args.phases:
        warm = args.rounds * (args.files - 1)
        print(f"\n== CPU per warm batch by thread and phase (means over {warm} warm batches of each backend; the "
              "phases are the RocksDB backend's, in the thread that runs them, each without the phases it calls)")
        for kind in clocks["heap"].threads:
            print(f"  {kind:<34s} heap {1e3 * clocks['heap'].threads[kind] / warm:6.1f} ms   rocksdb "
                  f"{1e3 * clocks['rocksdb'].threads[kind] / warm:6.1f} ms")
        for label, _, _ in _PHASES:
            print(f"  rocksdb: {label:<34s} {1e3 * clocks['rocksdb'].phases[label] / warm:6.1f} ms")


if __name__ == "__main__":
    sys.exit(main())
