"""RocksDB restore and per-key reads against their floors (issues 34 and 33), in one process, CPU time beside wall:

    python benchmarks/bench_rocksdb_restore.py                     # 400k keys
    python benchmarks/bench_rocksdb_restore.py --keys 400000 10000000

1. **Restore rate**: a checkpoint of ``--keys`` keys with two int64 ValueStates (written in bulk by the savepoint
   writer, p=2, max parallelism 128) restored by the three subtasks of p=3, on each backend: MB of checkpoint read
   per CPU-second (the heap restores lazily: it keeps the blocks and decodes a key group when first touched).
2. **The primitives of a RocksDB restore**, per row at 1M rows (the candidates measured before choosing the SST
   path): ``SstFileWriter[key] = value`` with the bytes objects made beforehand (the floor of any restore through
   rocksdict's writer: one Python-level call per row), with the database's bloom filter and without one (the
   restore's files), the same through ``_native/sstload`` from a keyed block
   (what a restore does per row), a ``WriteBatch.put`` per row plus the write and flush (the path before), and
   ``ingest_external_file`` of the finished file.
   Then where a RocksDB restore's CPU goes, per row: rows into the writer, finish, ingestion, reads and parsing.
3. **Per-key reads**: a batch of 100k distinct keys of the restored state: RocksDB's own point lookup through
   rocksdict (``db.get(key)``, the database keys built beforehand) for both states, against the backend's
   ``prefetch`` (database keys built and sorted, one multi-get per state, values decoded into the cache); medians
   of 4 batches.

The machine is shared: the load average is printed with every figure.
"""

from __future__ import annotations

import argparse
import collections
import io
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import numpy as np
import pyarrow as pa
import rocksdict

from keygroups import KeyGroupRange, assign_key_groups, key_group_range
from keygroups._native import sstload
from keygroups.checkpoint import CheckpointStorage
from keygroups.checkpoint.format import KeyedSnapshotWriter
from keygroups.runtime.state_writer import commit_savepoint, plan_savepoint, write_savepoint_subtask
from keygroups.serializers import Int64Serializer
from keygroups.state import HeapKeyedStateBackend, RocksDBKeyedStateBackend, ValueStateDescriptor
from keygroups.state.rocksdb import _sorted_db_keys
from keygroups.state import rocksdb_ingest
from keygroups.state.rocksdb_ingest import table_options

MAXP = 128


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def load() -> str:
    return "load %.1f" % os.getloadavg()[0]


def descriptors() -> tuple[ValueStateDescriptor, ValueStateDescriptor]:
    return ValueStateDescriptor("count", Int64Serializer()), ValueStateDescriptor("sum", Int64Serializer())


def write_state(location: str, n_keys: int) -> tuple[CheckpointStorage, Any, np.ndarray, float]:
    """The state of n_keys keys as a savepoint of p=2 (bulk writer); (storage, metadata, keys, CPU seconds)."""
    keys = np.arange(n_keys, dtype=np.int64) * 7919 + 11
    table = pa.table({"k": keys, "count": keys % 1000, "sum": keys * 3})
    c0 = cpu()
    plan = plan_savepoint(table.schema, location, "state", key_columns="k", states={"count": "count", "sum": "sum"},
                          max_parallelism=MAXP, parallelism=2)
    groups = np.asarray(assign_key_groups(keys, MAXP))
    handles = []
    for subtask in range(2):
        r = key_group_range(MAXP, 2, subtask)
        mine = np.flatnonzero((groups >= r.start) & (groups <= r.end))
        handles.append(write_savepoint_subtask(plan, subtask, table.take(pa.array(mine)).to_batches()))
    commit_savepoint(plan, handles)
    seconds = cpu() - c0
    storage = CheckpointStorage(location)
    return storage, storage.load_savepoint("state"), keys, seconds


def restore_rate(storage: CheckpointStorage, metadata: Any, keys: np.ndarray, runs: int) -> None:
    owners = np.asarray(assign_key_groups(keys, MAXP))
    for backend in (RocksDBKeyedStateBackend, HeapKeyedStateBackend):
        rates, walls, cpus = [], [], []
        for run in range(runs):
            total_bytes, total_cpu, total_wall = 0, 0.0, 0.0
            for i in range(3):
                r = key_group_range(MAXP, 3, i)
                b = backend(r, MAXP, Int64Serializer(), subtask_index=i)
                try:
                    c0, w0 = cpu(), time.perf_counter()
                    stats = b.restore(storage, metadata)
                    total_cpu += cpu() - c0
                    total_wall += time.perf_counter() - w0
                    total_bytes += stats.bytes_read
                    if run == 0:   # spot check: the restored values are the written ones
                        count, _ = (b.get_state(d) for d in descriptors())
                        for k in keys[(owners >= r.start) & (owners <= r.end)][:100].tolist():
                            b.set_current_key(k)
                            assert count.value() == k % 1000
                finally:
                    b.dispose()
            rates.append(total_bytes / 1e6 / total_cpu)
            walls.append(total_wall)
            cpus.append(total_cpu)
        print(f"  {backend.__name__:<28s} {total_bytes / 1e6:8.1f} MB restored (3 subtasks): "
              f"cpu {statistics.median(cpus):6.2f} s, wall {statistics.median(walls):6.2f} s: "
              f"{statistics.median(rates):6.1f} MB per CPU-second (median of {runs}; {load()})")


def primitives(work: str, rows: int = 1_000_000) -> None:
    keys = np.arange(rows, dtype=np.int64)
    m = np.zeros((rows, 16), dtype=np.uint8)
    m[:, 0:2] = (keys * 128 // rows).astype(">u2").view(np.uint8).reshape(rows, 2)
    m[:, 4:8] = np.array([8], ">u4").view(np.uint8)
    m[:, 8:16] = keys.astype(">i8").view(np.uint8).reshape(rows, 8)
    db_keys = m.view("V16").ravel().tolist()
    values = np.arange(rows, dtype="<i8").view("V8").tolist()
    options = rocksdict.Options(raw_mode=True)   # the database's table options: with its bloom filter
    options.set_block_based_table_factory(table_options())
    options.set_compression_type(rocksdict.DBCompressionType.none())
    ingested = rocksdb_ingest._writer_options()   # those of the files a restore ingests: no filter
    out: dict[str, list[float]] = collections.defaultdict(list)
    # one keyed block of the same rows, as a restore reads it
    buf = io.BytesIO()
    writer = KeyedSnapshotWriter(buf, KeyGroupRange(0, 0), [{"name": "v"}])
    key_bytes = keys.astype(">i8").view("V8").tolist()
    writer.write_key_group(0, [(0, key_bytes, values)])
    writer.finish()
    from keygroups.checkpoint.format import _offsets_block, open_snapshot
    snap = open_snapshot(buf.getvalue())
    block = _offsets_block(memoryview(buf.getvalue())[snap.offsets[0]:snap.offsets[1]], 0, 1, snap.version, None, 0,
                           verify=False)
    for _ in range(3):
        path = os.path.join(work, "floor.sst")
        w = rocksdict.SstFileWriter(options)
        w.open(path)
        c0 = cpu()
        collections.deque(map(w.__setitem__, db_keys, values), maxlen=0)
        w.finish()
        out["SstFileWriter[key] = value (objects made beforehand), finish"].append(cpu() - c0)
        w = rocksdict.SstFileWriter(ingested)
        w.open(path)
        c0 = cpu()
        collections.deque(map(w.__setitem__, db_keys, values), maxlen=0)
        w.finish()
        out["  the same without a bloom filter (the restore's files)"].append(cpu() - c0)
        w = rocksdict.SstFileWriter(ingested)
        w.open(path)
        c0 = cpu()
        sstload.write_key_group(w, 0, [(block.block, True, block.puts, block.deletes, [0])],
                                [(0, sstload.VALUE, False, None)])
        w.finish()
        out["sstload.write_key_group from a keyed block, finish"].append(cpu() - c0)
        db = rocksdict.Rdict(os.path.join(work, "db"), options)
        c0 = cpu()
        opts = rocksdict.IngestExternalFileOptions()
        opts.set_move_files(True)
        db.ingest_external_file([path], opts)
        out["ingest_external_file (moved)"].append(cpu() - c0)
        db.close()
        shutil.rmtree(os.path.join(work, "db"))
        db = rocksdict.Rdict(os.path.join(work, "db"), options)
        write = rocksdict.WriteOptions()
        write.disable_wal = True   # type: ignore[assignment,method-assign]
        db.set_write_options(write)
        c0 = cpu()
        batch = rocksdict.WriteBatch(raw_mode=True)
        collections.deque(map(batch.put, db_keys, values), maxlen=0)
        db.write(batch)
        db.flush()
        out["WriteBatch.put per row + write + flush"].append(cpu() - c0)
        db.close()
        shutil.rmtree(os.path.join(work, "db"))
    for name, times in out.items():
        print(f"  {name:<62s} {1e9 * statistics.median(times) / rows:6.0f} ns per row")


def breakdown(storage: CheckpointStorage, metadata: Any, runs: int) -> None:
    """Where a RocksDB restore's CPU goes, per row (the restores of p=3 from the p=2 savepoint): the compiled
    writer's rows through rocksdict's SstFileWriter (``sstload.write_key_group``), the file's finish and the temporary
    file, RocksDB's ingestion, and the rest (the ranged reads, checksums, block parsing, planning). Measured by
    wrapping the functions ``rocksdb_ingest`` calls."""
    phases: dict[str, float] = collections.defaultdict(float)
    real_write, real_ingest = sstload.write_key_group, rocksdb_ingest.SstRestore.ingest
    rows = 0

    def write_key_group(*args: Any) -> Any:
        nonlocal rows
        c0 = cpu()
        result = real_write(*args)
        phases["rows into the SST writer (sstload.write_key_group)"] += cpu() - c0
        rows += result[0]
        return result

    def ingest(self: Any, db: Any, directory: str, write: Any) -> int:
        def timed(f: Any) -> None:
            c0 = cpu()
            write(f)
            phases["ingest_external_file"] += cpu() - c0

        c0 = cpu()
        n = real_ingest(self, db, directory, timed)
        phases["SstRestore.ingest"] += cpu() - c0
        return n

    proxy = type("sstload", (), {"VALUE": sstload.VALUE, "LIST": sstload.LIST, "MAP": sstload.MAP,
                                 "write_key_group": staticmethod(write_key_group)})
    rocksdb_ingest.sstload, rocksdb_ingest.SstRestore.ingest = proxy, ingest   # type: ignore[assignment,method-assign]
    try:
        total = 0.0
        for _ in range(runs):
            for i in range(3):
                b = RocksDBKeyedStateBackend(key_group_range(MAXP, 3, i), MAXP, Int64Serializer(), subtask_index=i)
                try:
                    c0 = cpu()
                    b.restore(storage, metadata)
                    total += cpu() - c0
                finally:
                    b.dispose()
    finally:
        rocksdb_ingest.sstload, rocksdb_ingest.SstRestore.ingest = sstload, real_ingest  # type: ignore[method-assign]
    write_rows = phases["rows into the SST writer (sstload.write_key_group)"]
    ingestion = phases["ingest_external_file"]
    parts = {"rows into the SST writer (sstload.write_key_group)": write_rows,
             "finish, temporary file": phases["SstRestore.ingest"] - write_rows - ingestion,
             "ingest_external_file": ingestion,
             "reads, checksums, parsing, planning": total - phases["SstRestore.ingest"]}
    for name, seconds in parts.items():
        print(f"    {name:<52s} {1e9 * seconds / rows:6.1f} ns per row")
    print(f"    {'restore':<52s} {1e9 * total / rows:6.1f} ns per row ({rows // runs:,} rows; {load()})")


def point_and_prefetch(b: RocksDBKeyedStateBackend, batch: np.ndarray) -> tuple[float, float]:
    """CPU seconds per key of ``batch`` (distinct int64 keys) read with RocksDB's own point lookups of every state's
    database keys (``db.get`` per key: the baseline), then with ``b.prefetch`` (keys built, multi-get, decoded and
    cached); the second leaves the batch's keys in ``b``'s cache."""
    groups = np.asarray(assign_key_groups(batch, MAXP))
    listed = batch.tolist()
    serialize = Int64Serializer().serialize_many
    db_keys = [_sorted_db_keys(serialize, listed, groups, t.state_id, unique=True)[0] for t in b._tables.values()]
    get = b._db.get
    c0 = cpu()
    for state_keys in db_keys:
        collections.deque(map(get, state_keys), maxlen=0)
    point = (cpu() - c0) / len(listed)
    c0 = cpu()
    b.prefetch(listed, groups)
    return point, (cpu() - c0) / len(listed)


def reads(storage: CheckpointStorage, metadata: Any, keys: np.ndarray) -> None:
    b = RocksDBKeyedStateBackend(key_group_range(MAXP, 1, 0), MAXP, Int64Serializer())
    try:
        b.restore(storage, metadata)
        for d in descriptors():
            b.get_state(d)
        rng = np.random.default_rng(1)
        point, prefetch = [], []
        for _ in range(5):
            p, f = point_and_prefetch(b, np.unique(rng.choice(keys, 100_000)))
            point.append(p)
            prefetch.append(f)
            b._flush(evict=True)
        p, f = statistics.median(point[1:]), statistics.median(prefetch[1:])
        print(f"  RocksDB's point lookup (db.get per key, both states)   {1e9 * p:7.0f} ns per key")
        print(f"  backend.prefetch (keys built, multi-get, decode, cache) {1e9 * f:7.0f} ns per key  "
              f"= {f / p:.2f}x the point lookups ({load()})")
    finally:
        b.dispose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, nargs="+", default=[400_000])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--skip-primitives", action="store_true")
    args = parser.parse_args(argv)
    print(f"one process, CPU time of the process; machine shared ({load()} at start)")
    with tempfile.TemporaryDirectory() as work:
        if not args.skip_primitives:
            print("\nprimitives, 1,000,000 rows of 16-byte keys and 8-byte values:")
            primitives(work)
        for n in args.keys:
            location = os.path.join(work, f"state-{n}")
            storage, metadata, keys, seconds = write_state(location, n)
            print(f"\n{n:,} keys: savepoint written in bulk in {seconds:.2f} CPU-s")
            restore_rate(storage, metadata, keys, args.runs)
            print("  RocksDB restore, per row (all runs):")
            breakdown(storage, metadata, args.runs)
            reads(storage, metadata, keys)
            shutil.rmtree(location, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
