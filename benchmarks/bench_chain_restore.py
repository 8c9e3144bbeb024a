"""Restoring a chain of incremental checkpoints (issue 31, chain integrity): what a restore of 1M keys costs, so the
chain checks (each delta's predecessor, each block against its handle's checksum, the read cache against
``_metadata``) can be seen to stay O(bytes read).

    python benchmarks/bench_chain_restore.py [--keys 1000000] [--deltas 3] [--touched 0.1] [--runs 3]

A heap backend (max parallelism 128, one subtask, int64 keys, 40-byte str values) writes checkpoint 1 full and
``--deltas`` incremental checkpoints after it, each updating ``--touched`` of the keys, so each key group's chain is
a full block and the deltas after it. Then, medians of ``--runs`` (wall and process CPU time; the machine is shared):

* restore, lazy (values stay bytes) and eager (every value decoded), of the whole chain into a new backend, from a
  local location;
* the same lazy restore from a remote location (``memory://``) with a read cache, every range served from the cache;
* the baseline beside them: reading the same bytes as one raw local file, and ``plan_keyed_restore`` alone (the
  metadata-level chain check of the plan).

With ``--metadata-max-parallelism N`` (e.g. 32768, Flink's upper bound) it also measures what the chain records cost
in ``_metadata``, which every batch decodes: ``--metadata-parallelism`` heap backends (a few keys each) write
``--deltas`` + 1 checkpoints at max parallelism N, then the size of the newest ``_metadata``, the time to load it
(decode and validate every handle), to plan one subtask's restore and to commit the next checkpoint (whose chain
checks run over every key group) are printed.

Run it on two commits to compare before and after: it uses only the API both have.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
import uuid

from keygroups import KeyGroupRange
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, carry_forward, plan_keyed_restore
from keygroups.serializers import Int64Serializer, StrSerializer
from keygroups.state import HeapKeyedStateBackend, ValueStateDescriptor

MAXP = 128
EVERYTHING = KeyGroupRange(0, MAXP - 1)
VALUE = ValueStateDescriptor("v", StrSerializer())


def timed(fn, runs):
    """Medians of (wall, process CPU) seconds over ``runs`` calls, the cyclic GC collected before and paused during
    each."""
    walls, cpus = [], []
    for _ in range(runs):
        gc.collect()
        gc.disable()
        try:
            w0, c0 = time.perf_counter(), time.process_time()
            fn()
            walls.append(time.perf_counter() - w0)
            cpus.append(time.process_time() - c0)
        finally:
            gc.enable()
    return statistics.median(walls), statistics.median(cpus)


def write_chain(storage: CheckpointStorage, n_keys: int, deltas: int, touched: float) -> CheckpointMetadata:
    backend = HeapKeyedStateBackend(EVERYTHING, MAXP, Int64Serializer(), max_chain=deltas + 2, delta_fraction=10.0)
    state = backend.get_state(VALUE)
    previous = None
    step = max(1, round(1 / touched))
    for cid in range(1, deltas + 2):
        keys = range(n_keys) if cid == 1 else range(cid % step, n_keys, step)
        payload = f"{cid:02d}" + "x" * 38
        for k in keys:
            backend.set_current_key(k)
            state.update(payload)
        handle = backend.snapshot(cid, storage).result()
        md = CheckpointMetadata(checkpoint_id=cid, job_id="bench-chain", timestamp_ms=0, max_parallelism=MAXP,
                                parallelism=1, keyed_handles=carry_forward(previous, [handle]))
        storage.commit(md)
        previous = storage.load(cid)
    backend.dispose()
    return previous


def restore(storage: CheckpointStorage, md: CheckpointMetadata, lazy: bool, n_keys: int, check: bool):
    def go():
        backend = HeapKeyedStateBackend(EVERYTHING, MAXP, Int64Serializer())
        backend.restore(storage, md, lazy=lazy)
        state = backend.get_state(VALUE)
        if check:   # outside the timed runs: the restored state is the written one
            for k in (0, 1, n_keys // 2, n_keys - 1):
                backend.set_current_key(k)
                assert state.value() is not None and len(state.value()) == 40, (k, state.value())
        backend.dispose()
    return go


def bench_metadata(max_parallelism: int, parallelism: int, deltas: int, runs: int) -> None:
    from keygroups import key_group_range

    with tempfile.TemporaryDirectory(prefix="kg-bench-meta-") as tmp:
        storage = CheckpointStorage(os.path.join(tmp, "chk"), retain=deltas + 3)
        backends = [HeapKeyedStateBackend(key_group_range(max_parallelism, parallelism, i), max_parallelism,
                                          Int64Serializer(), subtask_index=i, max_chain=deltas + 2,
                                          delta_fraction=1000.0) for i in range(parallelism)]
        states = [b.get_state(VALUE) for b in backends]
        previous = None
        for cid in range(1, deltas + 3):
            for b, state in zip(backends, states):
                for k in range(cid * 1000, cid * 1000 + 50):
                    try:
                        b.set_current_key(k)
                    except Exception:   # a key of another subtask's key groups
                        continue
                    state.update("x")
            handles = [b.snapshot(cid, storage).result() for b in backends]
            md = CheckpointMetadata(checkpoint_id=cid, job_id="bench-meta", timestamp_ms=0,
                                    max_parallelism=max_parallelism, parallelism=parallelism,
                                    keyed_handles=carry_forward(previous, handles))
            if cid == deltas + 2:   # the commit timed below
                break
            storage.commit(md)
            previous = storage.load(cid)
        size = len(storage.read_bytes(f"chk-{previous.checkpoint_id}/_metadata"))
        load_wall, load_cpu = timed(lambda: storage.load(previous.checkpoint_id), runs)
        r = key_group_range(max_parallelism, parallelism, 0)
        plan_wall, plan_cpu = timed(lambda: plan_keyed_restore(previous, r), runs)
        check_wall, check_cpu = timed(lambda: CheckpointStorage._check_chains(md), runs)
        w0, c0 = time.perf_counter(), time.process_time()
        storage.commit(md)
        commit_wall, commit_cpu = time.perf_counter() - w0, time.process_time() - c0
        for b in backends:
            b.dispose()
        print(f"_metadata at max parallelism {max_parallelism:,}, parallelism {parallelism}, "
              f"{len(previous.keyed_handles)} keyed handles ({deltas + 1} checkpoints): {size / 1e3:,.1f} kB")
        print(f"  {'load (decode + validate every handle)':<52} {load_wall * 1e3:9.1f} ms wall "
              f"{load_cpu * 1e3:9.1f} ms CPU")
        print(f"  {'plan one subtask restore (chain checks of its range)':<52} {plan_wall * 1e3:9.1f} ms wall "
              f"{plan_cpu * 1e3:9.1f} ms CPU")
        print(f"  {'commit chain checks (every key group)':<52} {check_wall * 1e3:9.1f} ms wall "
              f"{check_cpu * 1e3:9.1f} ms CPU")
        print(f"  {'commit (checks, files, _metadata; once)':<52} {commit_wall * 1e3:9.1f} ms wall "
              f"{commit_cpu * 1e3:9.1f} ms CPU")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, default=1_000_000)
    p.add_argument("--deltas", type=int, default=3)
    p.add_argument("--touched", type=float, default=0.1)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--metadata-max-parallelism", type=int, default=0)
    p.add_argument("--metadata-parallelism", type=int, default=8)
    args = p.parse_args(argv)
    if args.metadata_max_parallelism:
        bench_metadata(args.metadata_max_parallelism, args.metadata_parallelism, args.deltas, args.runs)
        return
    with tempfile.TemporaryDirectory(prefix="kg-bench-chain-") as tmp:
        local = CheckpointStorage(os.path.join(tmp, "chk"), retain=args.deltas + 2)
        t0 = time.perf_counter()
        md = write_chain(local, args.keys, args.deltas, args.touched)
        files = sorted({h.file for h in md.keyed_handles})
        nbytes = sum(h.size for h in md.keyed_handles)
        print(f"{args.keys:,} keys, checkpoint 1 full + {args.deltas} deltas of {args.touched:.0%} of the keys: "
              f"{len(files)} keyed files, {nbytes / 1e6:.1f} MB (written in {time.perf_counter() - t0:.1f} s); "
              f"python {sys.version.split()[0]}; medians of {args.runs} runs, wall / process CPU, shared machine")
        raw = os.path.join(tmp, "raw")
        with open(raw, "wb") as f:
            f.write(os.urandom(1 << 20) * max(1, nbytes >> 20))

        def raw_read():
            with open(raw, "rb") as f:
                f.read()

        remote = CheckpointStorage(f"memory://kg-bench-chain-{uuid.uuid4().hex}", retain=args.deltas + 2,
                                   cache_dir=os.path.join(tmp, "cache"))
        for rel in files:   # the same checkpoint on a remote store, _metadata included
            with remote.open_write(rel) as out:
                out.write(local.read_bytes(rel))
        with remote.open_write(f"chk-{md.checkpoint_id}/_metadata") as out:
            out.write(local.read_bytes(f"chk-{md.checkpoint_id}/_metadata"))
        remote_md = remote.load(md.checkpoint_id)
        restore(remote, remote_md, True, args.keys, True)()   # fills the cache
        restore(local, md, True, args.keys, True)()
        restore(local, md, False, args.keys, True)()
        rows = [
            ("restore, lazy (local)", restore(local, md, True, args.keys, False)),
            ("restore, eager (local)", restore(local, md, False, args.keys, False)),
            ("restore, lazy (memory://, from the read cache)", restore(remote, remote_md, True, args.keys, False)),
            ("baseline: read the same bytes as one raw file", raw_read),
            ("plan_keyed_restore alone (metadata chain checks)", lambda: plan_keyed_restore(md, EVERYTHING)),
        ]
        base_wall = None
        for label, fn in rows:
            wall, cpu = timed(fn, args.runs)
            if label.startswith("baseline"):
                base_wall = wall
            print(f"  {label:<52} {wall * 1e3:9.1f} ms wall {cpu * 1e3:9.1f} ms CPU")
        lazy_wall, _ = timed(rows[0][1], 1)
        if base_wall:
            print(f"  lazy restore / raw read of the same bytes: {lazy_wall / base_wall:.1f}x (one more run)")


if __name__ == "__main__":
    main()
