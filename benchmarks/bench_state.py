"""Keyed state benchmark: heap (and, for context, RocksDB) state ops/s per core beside a plain dict doing the same
work, snapshot write and restore MB/s, bytes a rescaled restore reads per subtask against its ideal share, lazy vs
eager restore of 1M keys, and a 1%-touching batch on a restored 1M-key heap state with incremental vs full snapshots.

Run: python benchmarks/bench_state.py [--quick] [--rocksdb]
Every figure is the median of several runs; ours and the baseline are printed side by side with the ratio.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import tempfile
import time

from keygroups import KeyGroupRange, key_group_range
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.serializers import Int64Serializer, StrSerializer
from keygroups.state import HeapKeyedStateBackend, ListStateDescriptor, MapStateDescriptor, ValueStateDescriptor

MAXP = 128


def median_time(fn, runs):
    times = []
    for _ in range(runs):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def paired_times(ours, base, runs):
    """Medians of ours and of the baseline, run alternately so that load on a shared machine hits both alike."""
    t_ours, t_base = [], []
    for _ in range(runs):
        for fn, out in ((ours, t_ours), (base, t_base)):
            gc.collect()
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(t_ours), statistics.median(t_base)


def row(label, ours, base, unit, higher_is_better=True):
    ratio = ours / base if base else float("nan")
    note = "ours/baseline" if higher_is_better else "ours/baseline (lower is better)"
    print(f"  {label:<44} {ours:>14,.0f} {unit:<8} baseline {base:>14,.0f} {unit:<8} ratio {ratio:6.2f}  ({note})")


def bench_ops(n_keys, n_ops, runs):
    print(f"\nheap state ops/s on one core ({n_ops:,} ops over {n_keys:,} keys; baseline: a plain dict doing the same "
          "work)")
    keys = [i % n_keys for i in range(n_ops)]

    def fresh():
        b = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer())
        return (b, b.get_state(ValueStateDescriptor("v", Int64Serializer())),
                b.get_state(ListStateDescriptor("l", Int64Serializer())),
                b.get_state(MapStateDescriptor("m", StrSerializer(), Int64Serializer())))

    b, v, lst, m = fresh()

    def value_ours():
        for k in keys:
            b.set_current_key(k)
            v.update((v.value() or 0) + 1)

    def value_base():
        d = {}
        for k in keys:
            d[k] = (d.get(k) or 0) + 1

    def value_ours_nokey():  # the state access alone, key already set (as within one key's records)
        b.set_current_key(1)
        for _ in keys:
            v.update((v.value() or 0) + 1)

    def value_base_nokey():
        d = {}
        for _ in keys:
            d[1] = (d.get(1) or 0) + 1

    def list_ours():
        bb, _, ll, _ = fresh()
        for k in keys:
            bb.set_current_key(k)
            ll.add(k)

    def list_base():
        d = {}
        for k in keys:
            x = d.get(k)
            if x is None:
                d[k] = [k]
            else:
                x.append(k)

    def map_ours():
        bb, _, _, mm = fresh()
        for k in keys:
            bb.set_current_key(k)
            mm.put("a", k)

    def map_base():
        d = {}
        for k in keys:
            x = d.get(k)
            if x is None:
                d[k] = {"a": k}
            else:
                x["a"] = k

    def kg_only():
        for k in keys:
            b.set_current_key(k)

    # After a first snapshot the backend tracks the keys each batch changes (its next snapshot is a delta of them).
    tmp_tracked = tempfile.TemporaryDirectory(prefix="kg-bench-")
    tb, tv, _, _ = fresh()
    for k in range(n_keys):
        tb.set_current_key(k)
        tv.update(k)
    tb.snapshot(1, CheckpointStorage(tmp_tracked.name)).result()

    def value_ours_tracked():
        for k in keys:
            tb.set_current_key(k)
            tv.update((tv.value() or 0) + 1)

    for label, ours, base in (("value get+update (incl. set_current_key)", value_ours, value_base),
                              ("value get+update, dirty tracking on", value_ours_tracked, value_base),
                              ("value get+update (key already set)", value_ours_nokey, value_base_nokey),
                              ("list add (incl. set_current_key)", list_ours, list_base),
                              ("map put (incl. set_current_key)", map_ours, map_base)):
        t_ours, t_base = paired_times(ours, base, runs)
        row(label, n_ops / t_ours, n_ops / t_base, "ops/s")
    print(f"  (set_current_key alone, hashing the key to its key group: {n_ops / median_time(kg_only, runs):,.0f}/s)")
    tmp_tracked.cleanup()

    # The runner's pattern: a subtask restores (lazily) and then processes records; first touches decode.
    tmp = tempfile.TemporaryDirectory(prefix="kg-bench-")
    storage = CheckpointStorage(tmp.name)
    b0, v0, _, _ = fresh()
    for k in range(n_keys):
        b0.set_current_key(k)
        v0.update(k)
    md = commit(storage, [b0.snapshot(1, storage).result()], 1, 1)
    t_ours, t_base = [], []
    for _ in range(runs):
        nb = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer())
        nb.restore(storage, md)
        nv = nb.get_state(ValueStateDescriptor("v", Int64Serializer()))
        gc.collect()
        t0 = time.perf_counter()
        for k in keys:
            nb.set_current_key(k)
            nv.update((nv.value() or 0) + 1)
        t_ours.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        value_base()
        t_base.append(time.perf_counter() - t0)
    row("value get+update after a lazy restore", n_ops / statistics.median(t_ours),
        n_ops / statistics.median(t_base), "ops/s")
    tmp.cleanup()


def bench_incremental(n_keys, touched_fraction, runs):
    """A restored heap state of ``n_keys``, a batch touching ``touched_fraction`` of its keys, then its snapshot:
    incremental (a delta of the touched keys) against full (every key group rewritten, as before issue 11)."""
    touched = range(0, n_keys, round(1 / touched_fraction))
    print(f"\nheap: restore {n_keys:,} keys, touch {len(touched):,}, snapshot (baseline: the same with "
          "incremental=False, every snapshot full)")
    tmp = tempfile.TemporaryDirectory(prefix="kg-bench-")
    storage = CheckpointStorage(tmp.name, retain=1000)
    b, v = build(0)
    fill(b, v, range(n_keys))
    md = commit(storage, [b.snapshot(1, storage).result()], 1, 1)
    del b, v
    gc.collect()
    figures = {True: [], False: []}
    cid = 1
    for _ in range(runs):
        for incremental in (True, False):
            cid += 1
            nb = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer(), incremental=incremental)
            t0 = time.perf_counter()
            nb.restore(storage, md)
            nv = nb.get_state(ValueStateDescriptor("v", StrSerializer()))
            t1 = time.perf_counter()
            for k in touched:
                nb.set_current_key(k)
                nv.update(nv.value() + "!")
            t2 = time.perf_counter()
            handle = nb.snapshot(cid, storage).result()
            t3 = time.perf_counter()
            figures[incremental].append((t1 - t0, t2 - t1, t3 - t2, handle.size))
    full_size = md.keyed_handles[0].size
    for i, what in enumerate(("restore", f"touch {len(touched):,} keys (get+update)", "snapshot")):
        ours = statistics.median(f[i] for f in figures[True])
        base = statistics.median(f[i] for f in figures[False])
        print(f"  {what:<44} {ours * 1e3:>12,.1f} ms       baseline {base * 1e3:>12,.1f} ms       "
              f"ratio {base / ours:6.1f}x faster")
    size = statistics.median(f[3] for f in figures[True])
    print(f"  {'bytes the snapshot writes':<44} {size:>12,.0f} B        baseline {full_size:>12,.0f} B        "
          f"{size / full_size:6.1%} of the state")
    tmp.cleanup()


def _rss() -> int:
    """Resident bytes of this process now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bench_rocksdb_ops(n_keys, runs, batches=10):
    """RocksDB beside heap on one workload: a state of ``n_keys`` keys, then get+update (incl. set_current_key)
    once on every key, in ``batches`` batches of distinct keys; RocksDB prefetches each batch's keys and writes
    them back in one WriteBatch, as the runner does."""
    import numpy as np

    from keygroups import assign_key_groups
    from keygroups.state import RocksDBKeyedStateBackend

    size = n_keys // batches
    print(f"\nRocksDB beside heap: ValueState get+update incl. set_current_key, {n_keys:,}-key state, every key once "
          f"in batches of {size:,} keys; RocksDB prefetches each batch and writes it back (baseline: heap, same loop; "
          f"medians of {runs} paired runs)")
    keys = list(range(n_keys))
    chunks = [(keys[i:i + size], assign_key_groups(np.array(keys[i:i + size], dtype=np.int64), MAXP))
              for i in range(0, n_keys, size)]
    gc.collect()
    before = _rss()
    heap = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer())
    hv = heap.get_state(ValueStateDescriptor("v", Int64Serializer()))
    for k in keys:
        heap.set_current_key(k)
        hv.update(k)
    heap_bytes = (_rss() - before) / n_keys
    tmp = tempfile.TemporaryDirectory(prefix="kg-bench-")
    gc.collect()
    before = _rss()
    rocks = RocksDBKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer(), db_dir=tmp.name)
    rv = rocks.get_state(ValueStateDescriptor("v", Int64Serializer()))
    for chunk, _ in chunks:
        for k in chunk:
            rocks.set_current_key(k)
            rv.update(k)
        rocks._flush(evict=True)
    rocks._db.flush()
    gc.collect()
    rocks_bytes = (_rss() - before) / n_keys

    def heap_all():
        for k in keys:
            heap.set_current_key(k)
            hv.update((hv.value() or 0) + 1)

    parts = {"prefetch": [], "process": [], "flush": []}

    def rocks_all():
        spent = [0.0, 0.0, 0.0]
        for chunk, groups in chunks:
            t0 = time.perf_counter()
            rocks.prefetch(chunk, groups)
            t1 = time.perf_counter()
            for k in chunk:
                rocks.set_current_key(k)
                rv.update((rv.value() or 0) + 1)
            t2 = time.perf_counter()
            rocks._flush(evict=True)
            spent[0] += t1 - t0
            spent[1] += t2 - t1
            spent[2] += time.perf_counter() - t2
        for part, t in zip(parts, spent):
            parts[part].append(t)

    t_rocks, t_heap = paired_times(rocks_all, heap_all, runs)
    prefetch, process, flush = (statistics.median(parts[p]) for p in parts)
    row("value get+update, whole batch", n_keys / t_rocks, n_keys / t_heap, "ops/s")
    row("  of which processing (prefetched)", n_keys / process, n_keys / t_heap, "ops/s")
    print(f"  (ns per key, medians of {runs}: RocksDB prefetch {prefetch / n_keys * 1e9:,.0f} + processing "
          f"{process / n_keys * 1e9:,.0f} + write back {flush / n_keys * 1e9:,.0f} = {t_rocks / n_keys * 1e9:,.0f}; "
          f"heap {t_heap / n_keys * 1e9:,.0f}; target for RocksDB: 1,000 = 1M ops/s)")
    print(f"  resident bytes per key: RocksDB {rocks_bytes:,.0f} B/key (between batches), heap {heap_bytes:,.0f} B/key")
    rocks.dispose()
    tmp.cleanup()

    bench_rocksdb_delta(1_000_000 if n_keys >= 1_000_000 else n_keys, 0.01)

    print("\nRocksDB list and map ops/s on one core (100,000 ops over 2,000 keys, one batch incl. write back; "
          "baseline: heap, same loop)")
    small = [i % 2_000 for i in range(100_000)]

    def workloads(b):
        lst = b.get_state(ListStateDescriptor("l", Int64Serializer()))
        m = b.get_state(MapStateDescriptor("m", StrSerializer(), Int64Serializer()))
        flush = getattr(b, "_flush", lambda **_: None)

        def list_add():
            for k in small:
                b.set_current_key(k)
                lst.add(k)
            for k in range(2_000):
                b.set_current_key(k)
                lst.clear()
            flush(evict=True)

        def map_put():
            for k in small:
                b.set_current_key(k)
                m.put("a", k)
            flush(evict=True)

        return list_add, map_put

    rocks = RocksDBKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer())
    heap = HeapKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer())
    for label, ours, base in zip(("list add (incl. set_current_key)", "map put (incl. set_current_key)"),
                                 workloads(rocks), workloads(heap)):
        t_ours, t_base = paired_times(ours, base, 3)
        row(label, len(small) / t_ours, len(small) / t_base, "ops/s")
    rocks.dispose()


def bench_rocksdb_delta(n_keys, fraction):
    """A RocksDB snapshot after a batch that touched ``fraction`` of ``n_keys`` keys: incremental (a delta of what
    changed) against the full snapshot of the same state."""
    import numpy as np

    from keygroups import assign_key_groups
    from keygroups.checkpoint import carry_forward
    from keygroups.state import RocksDBKeyedStateBackend

    tmp = tempfile.TemporaryDirectory(prefix="kg-bench-")
    storage = CheckpointStorage(tmp.name)
    b = RocksDBKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer(), db_dir=tmp.name)
    v = b.get_state(ValueStateDescriptor("v", Int64Serializer()))
    for start in range(0, n_keys, 200_000):
        for k in range(start, min(start + 200_000, n_keys)):
            b.set_current_key(k)
            v.update(k)
        b._flush(evict=True)
    t0 = time.perf_counter()
    full = b.snapshot(1, storage).result()
    t_full = time.perf_counter() - t0
    md = commit(storage, [full], 1, 1)
    nb = RocksDBKeyedStateBackend(KeyGroupRange(0, MAXP - 1), MAXP, Int64Serializer(), db_dir=tmp.name)
    nb.restore(storage, md)
    nv = nb.get_state(ValueStateDescriptor("v", Int64Serializer()))
    touched = list(range(0, n_keys, round(1 / fraction)))
    nb.prefetch(touched, assign_key_groups(np.array(touched, dtype=np.int64), MAXP))
    for k in touched:
        nb.set_current_key(k)
        nv.update(nv.value() + 1)
    t0 = time.perf_counter()
    future = nb.snapshot(2, storage)
    t_sync = time.perf_counter() - t0
    delta = future.result()
    t_delta = time.perf_counter() - t0
    assert not delta.full_key_groups and carry_forward(md, [delta])
    print(f"\nRocksDB snapshot after a batch touching {fraction:.0%} of {n_keys:,} keys (baseline: a full snapshot)")
    print(f"  {'delta snapshot (incl. writing the batch back)':<44} {t_delta * 1e3:>12,.0f} ms       "
          f"baseline (full) {t_full * 1e3:>10,.0f} ms       ratio {t_full / t_delta:6.1f}x faster"
          f"   ({t_sync * 1e3:,.0f} ms synchronous; {delta.size / 1e6:.2f} MB vs {full.size / 1e6:.1f} MB)")
    nb.dispose()
    b.dispose()
    tmp.cleanup()


def build(n_keys, kgr=KeyGroupRange(0, MAXP - 1), maxp=MAXP, subtask=0, incremental=True):
    b = HeapKeyedStateBackend(kgr, maxp, Int64Serializer(), subtask_index=subtask, incremental=incremental)
    v = b.get_state(ValueStateDescriptor("v", StrSerializer()))
    return b, v


def fill(b, v, keys):
    payload = "x" * 40
    for k in keys:
        b.set_current_key(k)
        v.update(payload)


def commit(storage, handles, cid, p, maxp=MAXP):
    storage.commit(CheckpointMetadata(checkpoint_id=cid, job_id="bench", timestamp_ms=0, max_parallelism=maxp,
                                      parallelism=p, keyed_handles=handles, operator_handles=[], properties={}))
    return storage.load(cid)


def bench_snapshot_restore(n_keys, runs):
    print(f"\nsnapshot write / restore ({n_keys:,} keys, 40-byte str values, one subtask; baseline: writing / reading "
          "the same bytes as one raw file)")
    tmp = tempfile.TemporaryDirectory(prefix="kg-bench-")
    storage = CheckpointStorage(tmp.name)
    b, v = build(n_keys, incremental=False)  # every snapshot writes the whole state: what this section measures
    fill(b, v, range(n_keys))
    cid = [0]
    handle = None

    def snap():
        nonlocal handle
        cid[0] += 1
        handle = b.snapshot(cid[0], storage).result()

    snap()
    size = handle.size
    blob = b"x" * size

    def raw_write():
        with open(f"{tmp.name}/raw", "wb") as f:
            f.write(blob)

    def raw_read():
        with open(f"{tmp.name}/raw", "rb") as f:
            f.read()

    t_snap, t_raw_w = paired_times(snap, raw_write, runs)
    md = commit(storage, [handle], cid[0], 1)

    def restore(lazy):
        def go():
            nb, nv = build(0)
            nb.restore(storage, md, lazy=lazy)
            nb.get_state(ValueStateDescriptor("v", StrSerializer()))
        return go

    mb = size / 1e6
    row("snapshot write (capture + async write)", mb / t_snap, mb / t_raw_w, "MB/s")
    t_lazy, t_raw_r = paired_times(restore(True), raw_read, runs)
    row("restore, lazy (values stay bytes)", mb / t_lazy, mb / t_raw_r, "MB/s")
    t_eager, t_raw_r = paired_times(restore(False), raw_read, runs)
    row("restore, eager (every value decoded)", mb / t_eager, mb / t_raw_r, "MB/s")
    futures = []
    t_sync = median_time(lambda: futures.append(b.snapshot(cid[0] + 100 + len(futures), storage)), runs)
    for f in futures:  # let the background writes finish before the directory goes
        f.result()
    print(f"  synchronous capture of {n_keys:,} keys: {t_sync * 1e3:.2f} ms (the part that blocks processing; "
          "the rest is written in a background thread)")
    tmp.cleanup()


def bench_rescale(n_keys, p, p2, runs):
    print(f"\nrescaled restore {p} -> {p2} subtasks (max parallelism {MAXP}, {n_keys:,} keys): bytes read per subtask "
          "vs its ideal share (its key groups' fraction of the checkpoint; target <= 1.1x)")
    tmp = tempfile.TemporaryDirectory(prefix="kg-bench-")
    storage = CheckpointStorage(tmp.name)
    handles = []
    from keygroups import assign_operators
    import numpy as np

    keys = np.arange(n_keys, dtype=np.int64)
    owners = assign_operators(keys, MAXP, p)
    for i in range(p):
        b, v = build(0, key_group_range(MAXP, p, i), subtask=i)
        fill(b, v, keys[owners == i].tolist())
        handles.append(b.snapshot(1, storage).result())
    md = commit(storage, handles, 1, p)
    total = sum(h.offsets[-1] - h.offsets[0] for h in handles)
    ratios = []
    naive = []
    for j in range(p2):
        kgr = key_group_range(MAXP, p2, j)
        reads = []
        for _ in range(runs):
            nb, _ = build(0, kgr, subtask=j)
            reads.append(nb.restore(storage, md).bytes_read)
        ideal = total * len(kgr) / MAXP
        ratios.append(statistics.median(reads) / ideal)
        naive.append(sum(h.size for h in handles if h.key_group_range.intersection(kgr)) / ideal)
    print(f"  {'bytes read / ideal share, median (max)':<44} {statistics.median(ratios):>10.3f}x ({max(ratios):.3f}x)"
          f"   baseline: whole intersecting old files {statistics.median(naive):.2f}x ({max(naive):.2f}x)"
          f"   ratio {statistics.median(ratios) / statistics.median(naive):.2f}")
    tmp.cleanup()


def bench_lazy(n_keys, runs):
    print(f"\nlazy vs eager restore of {n_keys:,} keys: time until the first value can be read (baseline: eager)")
    tmp = tempfile.TemporaryDirectory(prefix="kg-bench-")
    storage = CheckpointStorage(tmp.name)
    b, v = build(0)
    fill(b, v, range(n_keys))
    md = commit(storage, [b.snapshot(1, storage).result()], 1, 1)
    del b, v
    gc.collect()

    def first_read(lazy):
        def go():
            nb, _ = build(0)
            nb.restore(storage, md, lazy=lazy)
            nv = nb.get_state(ValueStateDescriptor("v", StrSerializer()))
            nb.set_current_key(12345)
            assert nv.value() is not None
        return go

    t_lazy, t_eager = paired_times(first_read(True), first_read(False), runs)
    print(f"  {'lazy restore, first value':<44} {t_lazy * 1e3:>12,.1f} ms       "
          f"baseline (eager) {t_eager * 1e3:>10,.1f} ms"
          f"       ratio {t_eager / t_lazy:6.1f}x faster")
    tmp.cleanup()


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    ap.add_argument("--rocksdb", action="store_true", help="only the RocksDB rows")
    a = ap.parse_args()
    q = a.quick
    runs = 3 if q else 5
    if a.rocksdb:
        bench_rocksdb_ops(200_000 if q else 2_000_000, 3)
        return
    bench_ops(10_000, 50_000 if q else 300_000, runs)
    bench_rocksdb_ops(200_000 if q else 2_000_000, 3)
    bench_snapshot_restore(50_000 if q else 300_000, runs)
    bench_rescale(20_000 if q else 200_000, 4, 7, 3)
    bench_lazy(100_000 if q else 1_000_000, 3)
    bench_incremental(100_000 if q else 1_000_000, 0.01, 3)


if __name__ == "__main__":
    main()
