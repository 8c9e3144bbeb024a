"""write_savepoint's bulk framing (issue 34, bulk loading) against the value-by-value path it replaced, in one
process, CPU time beside wall:

    python benchmarks/bench_savepoint_write.py                      # 1M keys
    python benchmarks/bench_savepoint_write.py --keys 1000000 --runs 3

The same savepoint written twice per run by ``write_savepoint_subtask`` (p=2, max parallelism 128; the subtasks one
after the other): once as it runs (each state's parts serialized by one ``serialize_many`` call per role, frames and
TTL stamps laid in compiled code: ``_native/bulkframe.pyx``), once with the bulk framing turned off (``_framed``
answering None: every value of the list, map, TTL and partly null states encoded one by one in Python, the path
before). The states, per key:

* ``events``: a list state of 1-4 int64 elements;
* ``last seen``: a map state of 1-3 string -> int64 entries;
* ``score``: an int64 value state with TTL, its timestamps from a ms column;
* ``label``: a string value state, null for a third of the keys (only the others are written).

The first run checks the two savepoints hold the same bytes. Medians of ``--runs`` runs. The machine is shared: the
load average is printed with every figure.

Memory (``--memory``): one subtask (p=1) of ``--keys`` keys with two int64 value states, its rows fed batch by batch
(10k rows each, as Spark feeds a task; generated on the fly, so the input itself is never held), written once
streaming (``chunk_rows`` as it runs: spilled in sorted runs, encoded a chunk of key groups at a time) and once with
the whole input at once (``chunk_rows`` past the key count: the writer before streaming), each in a fresh process
whose anonymous resident memory (``RssAnon``, without the memory-mapped spill file's page cache, which the kernel
drops under pressure) is sampled every 5 ms from outside:

    python benchmarks/bench_savepoint_write.py --memory --keys 1000000 10000000
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from keygroups import assign_key_groups, key_group_range
from keygroups.checkpoint import CheckpointStorage, read_key_groups
from keygroups.runtime import state_writer
from keygroups.runtime.state_writer import StateColumn, commit_savepoint, plan_savepoint, write_savepoint_subtask
from keygroups.state import StateTtlConfig

MAXP = 128
TTL = StateTtlConfig.new_builder(3600).build()


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def load() -> str:
    return "load %.1f" % os.getloadavg()[0]


def table_of(n_keys: int) -> pa.Table:
    """n_keys keys and their four states' columns, built in bulk (Arrow from numpy, no per-row Python)."""
    rng = np.random.default_rng(7)
    keys = np.arange(n_keys, dtype=np.int64) * 7919 + 11
    lengths = rng.integers(1, 5, n_keys)
    offsets = np.zeros(n_keys + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    events = pa.ListArray.from_arrays(pa.array(offsets), pa.array(rng.integers(0, 1 << 40, int(offsets[-1]))))
    entries = rng.integers(1, 4, n_keys)
    map_offsets = np.zeros(n_keys + 1, dtype=np.int32)
    np.cumsum(entries, out=map_offsets[1:])
    position = np.arange(int(map_offsets[-1])) - np.repeat(map_offsets[:-1], entries)   # 0, 1, 2 within each map
    names = np.array(["page", "cart", "checkout"])[position]
    last_seen = pa.MapArray.from_arrays(pa.array(map_offsets), pa.array(names),
                                        pa.array(rng.integers(0, 1 << 40, len(position))))
    labels = pa.array(np.char.add("user-", (keys % 100_000).astype(str)))
    labels = pc.if_else(pa.array(keys % 3 == 0), pa.scalar(None, pa.string()), labels)
    return pa.table({"k": keys, "events": events, "last seen": last_seen, "score": keys % 1000,
                     "at": 1_700_000_000_000 + keys % 86_400_000, "label": labels})


STATES = {"events": "events", "last seen": "last seen", "score": StateColumn("score", ttl=TTL, ttl_column="at"),
          "label": "label"}


def write(location: str, table: pa.Table, groups: np.ndarray) -> Any:
    plan = plan_savepoint(table.schema, location, "s", key_columns="k", states=STATES, max_parallelism=MAXP,
                          parallelism=2)
    handles = []
    for subtask in range(2):
        r = key_group_range(MAXP, 2, subtask)
        mine = np.flatnonzero((groups >= r.start) & (groups <= r.end))
        handles.append(write_savepoint_subtask(plan, subtask, table.take(pa.array(mine)).to_batches()))
    return commit_savepoint(plan, handles)


def entries(location: str, metadata: Any) -> dict[Any, bytes]:
    storage = CheckpointStorage(location)
    out = {}
    for handle in metadata.keyed_handles:
        blocks, _ = read_key_groups(storage, handle, handle.key_group_range, copy=True)
        for block in blocks:
            for index, keys, values in block.puts:
                for k, v in zip(keys, values):
                    out[(block.key_group, handle.states[index]["name"], bytes(k))] = bytes(v)
    return out


def _memory_child(n_keys: int, chunk_rows: int) -> None:
    """In a fresh process: write subtask 0 of 1 from n_keys rows fed in 10k-row batches; print CPU and wall."""
    schema = pa.schema([("k", pa.int64()), ("count", pa.int64()), ("sum", pa.int64())])

    def batches() -> Any:
        for start in range(0, n_keys, 10_000):
            ids = np.arange(start, min(n_keys, start + 10_000), dtype=np.int64)
            yield pa.record_batch([ids * 7919 + 11, ids % 1000, ids * 3], schema=schema)

    work = tempfile.mkdtemp(prefix="bench-savepoint-memory-")
    try:
        plan = plan_savepoint(schema, work, "s", key_columns="k", states={"count": "count", "sum": "sum"},
                              max_parallelism=MAXP, parallelism=1)
        print("ready", flush=True)
        c0, w0 = cpu(), time.perf_counter()
        handle = write_savepoint_subtask(plan, 0, batches(), chunk_rows=chunk_rows)
        assert handle is not None
        print(json.dumps({"cpu": cpu() - c0, "wall": time.perf_counter() - w0, "bytes": handle.size}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _rss_anon(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def measure_memory(n_keys: int, chunk_rows: int) -> dict[str, float]:
    """Peak anonymous resident bytes of a writer process over its resident bytes once ready to write."""
    child = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--memory-child", str(n_keys),
                              str(chunk_rows)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    base = peak = _rss_anon(child.pid)
    while child.poll() is None:
        try:
            peak = max(peak, _rss_anon(child.pid))
        except (OSError, ValueError):
            break
        time.sleep(0.005)
    out = json.loads(child.stdout.read().strip().splitlines()[-1])
    if child.wait() != 0:
        raise RuntimeError(f"the writer process failed ({child.returncode})")
    out["peak"] = peak - base
    return out


def memory(keys: list[int], runs: int) -> None:
    print(f"memory of one writer task: two int64 value states, p=1, max parallelism {MAXP}, input fed in 10k-row "
          f"batches; streaming chunk_rows = {state_writer.CHUNK_ROWS:,}")
    for n_keys in keys:
        figures: dict[str, list[dict[str, float]]] = {"streaming": [], "whole input at once": []}
        for _ in range(runs):
            figures["streaming"].append(measure_memory(n_keys, state_writer.CHUNK_ROWS))
            figures["whole input at once"].append(measure_memory(n_keys, n_keys + 1))
        print(f"{n_keys:,} keys")
        peaks = {}
        for name, got in figures.items():
            peaks[name] = statistics.median(f["peak"] for f in got)
            print(f"  {name:<22s} peak {peaks[name] / 1e6:8.1f} MB ({peaks[name] / n_keys:6.1f} B/key)  "
                  f"cpu {statistics.median(f['cpu'] for f in got):6.2f} s  wall "
                  f"{statistics.median(f['wall'] for f in got):6.2f} s  (median of {runs}; {load()})")
        print(f"  at once / streaming: {peaks['whole input at once'] / peaks['streaming']:.1f}x peak memory")


def main(argv: list[str] | None = None) -> int:
    if argv is None and len(sys.argv) == 4 and sys.argv[1] == "--memory-child":
        _memory_child(int(sys.argv[2]), int(sys.argv[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--memory", action="store_true", help="peak memory of a writer task, streaming vs at once")
    args = parser.parse_args(argv)
    if args.memory:
        memory(args.keys, args.runs)
        return 0
    args.keys = args.keys[0]
    table = table_of(args.keys)
    groups = np.asarray(assign_key_groups(table.column("k"), MAXP))
    real = state_writer._framed
    paths = {"bulk (as it runs)": real, "value by value (bulk framing off)": lambda *a: None}
    cpus: dict[str, list[float]] = {name: [] for name in paths}
    walls: dict[str, list[float]] = {name: [] for name in paths}
    print(f"{args.keys:,} keys; states: list (1-4 int64), map (1-3 str -> int64), int64 with TTL, string a third "
          f"null; p=2; {table.nbytes / 1e6:.0f} MB of Arrow input")
    work = tempfile.mkdtemp(prefix="bench-savepoint-write-")
    try:
        for run in range(args.runs):
            written = {}
            for name, framed in paths.items():
                location = os.path.join(work, f"{run}-{len(written)}")
                state_writer._framed = framed   # type: ignore[assignment]
                try:
                    c0, w0 = cpu(), time.perf_counter()
                    metadata = write(location, table, groups)
                    cpus[name].append(cpu() - c0)
                    walls[name].append(time.perf_counter() - w0)
                finally:
                    state_writer._framed = real   # type: ignore[assignment]
                written[name] = (location, metadata)
            if run == 0:
                bulk, values = (entries(*w) for w in written.values())
                assert bulk == values, "the bulk and value-by-value savepoints differ"
                print(f"  the same {len(bulk):,} entries, byte for byte, both ways")
            for location, _ in written.values():
                shutil.rmtree(location)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for name in paths:
        print(f"  {name:<36s} cpu {statistics.median(cpus[name]):6.2f} s, wall {statistics.median(walls[name]):6.2f} s"
              f" (median of {args.runs}; {load()})")
    names = list(paths)
    print(f"  value by value / bulk: {statistics.median(cpus[names[1]]) / statistics.median(cpus[names[0]]):.1f}x "
          f"CPU, {statistics.median(walls[names[1]]) / statistics.median(walls[names[0]]):.1f}x wall")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
