"""Issue 33 item 1: what a per-record job's string and bool outputs cost, the compiled sink's typed buffers against
the build before them (string and bool columns as Python lists for ``pa.array``) and the pure-Python floor.

    python benchmarks/bench_output_types.py                       # 1M events, 100k keys, medians of 3
    python benchmarks/bench_output_types.py --before-python /path/to/python   # the build to compare against

The job (:class:`Labelled`): per key a running count (one ValueState), read and updated once per record, one output
row ``(key, user, count, even)`` per record: ``user`` the record's string column, ``even`` a bool. The events:
``--events`` records over ``--keys`` keys in ``--files`` Parquet files (= batches), ``user`` = ``"user-<key>"``.

Candidates, each in a fresh process, interleaved (round r runs each once, the order rotating), medians of ``--runs``:

- ``keygroups (this build)``: the job through ``KeyedFunctionHarness`` (heap, p=2, max p 128), one ``process`` and
  one ``output_table`` per file, with this interpreter (this worktree's build); ``subtasks CPU`` is the CPU spent
  inside ``run_keyed_subtask`` (the subtask's own work).
- ``keygroups (before)``: the same, run by ``--before-python`` (an interpreter whose ``keygroups`` is the build to
  compare with, e.g. main's install); its ``keygroups.__file__`` is printed.
- ``pure-Python floor``: the job's own ``process_element`` called per record from a plain loop over the same
  batches, each record a dict of its columns, the state a dict-backed object, the output tuples made into an Arrow
  table per batch (``zip`` and ``pa.array`` per column): the per-record API with no runtime around it.
- ``sink alone`` (this build, before, and the floor's ``zip`` + ``pa.array``): the same output rows (``--events``
  tuples of int, str, int, bool), made into one table: the output's share of the cost, without the function.

CPU is ``time.process_time`` of the child over the timed span, wall ``time.perf_counter``; the machine is shared, so
the CPU figures are the steadier. Every candidate's output is checked (rows, sum of counts, count of even flags,
total length of the user strings).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
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
import pyarrow.parquet as pq

PARALLELISM = 2
MAX_PARALLELISM = 128
OUTPUT = pa.schema([("key", pa.int64()), ("user", pa.string()), ("count", pa.int64()), ("even", pa.bool_())])


def _job() -> Any:
    from keygroups.runtime import KeyedProcessFunction
    from keygroups.serializers import Int64Serializer
    from keygroups.state import ValueStateDescriptor

    count_state = ValueStateDescriptor("count", Int64Serializer())

    class Labelled(KeyedProcessFunction):
        """Per record: the key's running count, emitted as ``(key, user, count, count is even)``."""

        def open(self, context):
            self.count = context.get_state(count_state)

        def process_element(self, record, context):
            count = (self.count.value() or 0) + 1
            self.count.update(count)
            return ((record["key"], record["user"], count, count % 2 == 0),)

    return Labelled


def generate(directory: pathlib.Path, events: int, keys: int, files: int, seed: int = 33) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i, size in enumerate(np.diff(np.linspace(0, events, files + 1).astype(np.int64))):
        key = rng.integers(0, keys, int(size), dtype=np.int64)
        user = pc.binary_join_element_wise("user-", pc.cast(pa.array(key), pa.string()), "")
        path = directory / f"part-{i:03d}.parquet"
        pq.write_table(pa.table({"key": key, "user": user, "value": rng.integers(0, 100, int(size))}), path)
        paths.append(str(path))
    return paths


def _checks(table: pa.Table) -> list[int]:
    return [table.num_rows, int(pc.sum(table.column("count")).as_py() or 0),
            int(pc.sum(pc.cast(table.column("even"), pa.int64())).as_py() or 0),
            int(pc.sum(pc.utf8_length(table.column("user"))).as_py() or 0)]


def _add(total: list[int], part: list[int]) -> list[int]:
    return [a + b for a, b in zip(total, part)] if total else part


# ---- the candidates, run in a child process --------------------------------------------------------------------------

def run_keygroups(files: list[str]) -> dict[str, Any]:
    import keygroups
    import keygroups.runtime.local as local
    from keygroups.testing import KeyedFunctionHarness

    tables = [pq.read_table(f) for f in files]
    spent = [0.0]
    run = local.run_keyed_subtask

    def timed(*args: Any, **kwargs: Any) -> Any:
        c = time.process_time()
        try:
            return run(*args, **kwargs)
        finally:
            spent[0] += time.process_time() - c

    local.run_keyed_subtask = timed   # the harness's subtasks run through the local executor
    checks: list[int] = []
    with KeyedFunctionHarness(_job()(), "key", output_schema=OUTPUT, max_parallelism=MAX_PARALLELISM,
                              parallelism=PARALLELISM, backend="heap") as h:
        c0, t0 = time.process_time(), time.perf_counter()
        for table in tables:
            h.process(table)
            checks = _add(checks, _checks(h.output_table()))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"wall": wall, "cpu": cpu, "subtasks_cpu": spent[0], "checks": checks, "keygroups": keygroups.__file__}


class _DictState:
    __slots__ = ("current", "data")

    def __init__(self, current: list[Any]) -> None:
        self.current = current
        self.data: dict[Any, Any] = {}

    def value(self) -> Any:
        return self.data.get(self.current[0])

    def update(self, value: Any) -> None:
        self.data[self.current[0]] = value


class _DictContext:
    def __init__(self) -> None:
        self.current = [None]

    def get_state(self, descriptor: Any) -> _DictState:
        return _DictState(self.current)


def _floor_table(rows: list[tuple[Any, ...]]) -> pa.Table:
    columns = list(zip(*rows))
    return pa.Table.from_arrays([pa.array(c, type=f.type) for c, f in zip(columns, OUTPUT)], schema=OUTPUT)


def run_floor(files: list[str]) -> dict[str, Any]:
    tables = [pq.read_table(f) for f in files]
    function = _job()()
    context = _DictContext()
    function.open(context)
    current = context.current
    checks: list[int] = []
    c0, t0 = time.process_time(), time.perf_counter()
    for table in tables:
        for batch in table.to_batches():
            names = batch.schema.names
            out: list[tuple[Any, ...]] = []
            for values in zip(*[c.to_pylist() for c in batch.columns]):
                current[0] = values[0]
                out.extend(function.process_element(dict(zip(names, values)), None))
            checks = _add(checks, _checks(_floor_table(out)))
    return {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0, "checks": checks}


def _rows(files: list[str]) -> list[tuple[Any, ...]]:
    table = pq.read_table(files)
    key, user = table.column("key").to_pylist(), table.column("user").to_pylist()
    return [(k, u, i, i % 2 == 0) for i, (k, u) in enumerate(zip(key, user))]


def run_sink(files: list[str]) -> dict[str, Any]:
    import keygroups
    from keygroups._native.recordloop import OutputSink

    rows = _rows(files)
    sink = OutputSink(OUTPUT)
    c0, t0 = time.process_time(), time.perf_counter()
    sink.extend(rows)
    table = sink.table()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"wall": wall, "cpu": cpu, "checks": _checks(table), "keygroups": keygroups.__file__}


def run_sink_floor(files: list[str]) -> dict[str, Any]:
    rows = _rows(files)
    c0, t0 = time.process_time(), time.perf_counter()
    table = _floor_table(rows)
    return {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0, "checks": _checks(table)}


CHILDREN = {"keygroups": run_keygroups, "floor": run_floor, "sink": run_sink, "sink-floor": run_sink_floor}


# ---- the parent ------------------------------------------------------------------------------------------------------

def _load() -> str:
    return f"load {os.getloadavg()[0]:.1f}"


def _child(python: str, which: str, files: list[str], before: bool) -> dict[str, Any]:
    env = dict(os.environ)
    if before:   # the build to compare with: its own packages only
        env = {k: v for k, v in env.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([python, os.path.abspath(__file__), "--child", which, *files], capture_output=True,
                          text=True, env=env, cwd=tempfile.gettempdir())
    if done.returncode:
        raise SystemExit(f"{which} ({python}) failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--keys", type=int, default=100_000)
    parser.add_argument("--files", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--before-python", default=None,
                        help="an interpreter whose keygroups is the build to compare with (left out if not given)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    if args.child:
        print(json.dumps(CHILDREN[args.child](rest)))
        return 0

    work = pathlib.Path(tempfile.mkdtemp(prefix="kg-bench-output-types-"))
    try:
        files = generate(work / "events", args.events, args.keys, args.files)
        candidates: dict[str, tuple[str, str]] = {"keygroups (this build)": (sys.executable, "keygroups")}
        if args.before_python:
            candidates["keygroups (before)"] = (args.before_python, "keygroups")
        candidates["pure-Python floor"] = (sys.executable, "floor")
        candidates["sink alone (this build)"] = (sys.executable, "sink")
        if args.before_python:
            candidates["sink alone (before)"] = (args.before_python, "sink")
        candidates["sink alone: zip + pa.array"] = (sys.executable, "sink-floor")
        print(f"{args.events:,} events, {args.keys:,} keys, {args.files} batches, p={PARALLELISM}, max p "
              f"{MAX_PARALLELISM}; output (key int64, user string, count int64, even bool); {args.runs} "
              f"interleaved rounds; {_load()} (2 cores, shared machine)", flush=True)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in candidates}
        names = list(candidates)
        expected: dict[str, list[int]] = {}
        for r in range(args.runs):
            for name in names[r % len(names):] + names[:r % len(names)]:
                python, which = candidates[name]
                result = _child(python, which, files, "(before)" in name)
                group = "sink" if which.startswith("sink") else "job"
                if expected.setdefault(group, result["checks"]) != result["checks"]:
                    raise SystemExit(f"{name}: output {result['checks']} differs from {expected[group]}")
                runs[name].append(result)
                where = f" [{result['keygroups']}]" if r == 0 and "keygroups" in result else ""
                print(f"  round {r + 1}: {name:<28} {result['wall']:6.2f} s wall {result['cpu']:6.2f} s CPU"
                      f"{where}; {_load()}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    n = args.events
    med = {name: {k: statistics.median(x[k] for x in rs) for k in ("wall", "cpu", "subtasks_cpu") if k in rs[0]}
           for name, rs in runs.items()}
    print(f"\n== medians of {args.runs}: {n:,} records; {_load()}")
    print(f"{'candidate':<30}{'wall s':>8}{'CPU s':>8}{'CPU µs/rec':>12}{'subtasks CPU µs/rec':>22}")
    for name, m in med.items():
        sub = f"{m['subtasks_cpu'] / n * 1e6:>22.2f}" if "subtasks_cpu" in m else ""
        print(f"{name:<30}{m['wall']:>8.2f}{m['cpu']:>8.2f}{m['cpu'] / n * 1e6:>12.2f}{sub}")
    print("\nratios (CPU):")
    pairs = [("keygroups (this build)", "pure-Python floor"), ("keygroups (before)", "pure-Python floor"),
             ("keygroups (this build)", "keygroups (before)"),
             ("sink alone (this build)", "sink alone: zip + pa.array"),
             ("sink alone (before)", "sink alone: zip + pa.array"), ("sink alone (this build)", "sink alone (before)")]
    for first, second in pairs:
        if first in med and second in med:
            print(f"  {first} / {second}: {med[first]['cpu'] / med[second]['cpu']:.2f}x")
    if "keygroups (before)" in med:
        now, before = med["keygroups (this build)"], med["keygroups (before)"]
        print(f"  subtasks CPU, this build / before: {now['subtasks_cpu'] / before['subtasks_cpu']:.2f}x "
              f"({(before['subtasks_cpu'] - now['subtasks_cpu']) / n * 1e6:.2f} µs/rec less)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
