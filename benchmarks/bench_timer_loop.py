"""Issue 33 item 1: what firing a timer costs against what a record costs, the compiled firing loop against the build
before it (``--before-python``).

    python benchmarks/bench_timer_loop.py                                  # 1M keys, medians of 3
    python benchmarks/bench_timer_loop.py --before-python /path/to/python  # and the build to compare against

One subtask (parallelism 1, heap backend) through the runtime the Spark runner uses (``bench_timers._micro_batch``:
begin_batch / run_keyed_subtask / commit_batch), ``--keys`` keys:

- timers: a batch of one record per key registering one event-time timer, then a batch with no records whose
  watermark passes every timer (warm: the backend and its queues kept from the previous batch): each timer fires
  once, ``on_timer`` returns None. Timed: the subtask's firing of its timers (``subtask._fire_timers``: the queue
  pops, the key switch, the hidden state's check and removal, the ``on_timer`` call).
- records (the baseline): a batch writing one ValueState per key, then a batch of the same records whose
  ``process_element`` reads the value and clears it. Timed: the subtask's records loop (``subtask._process``).

Each build runs in its own process; CPU (``time.process_time``) beside wall, per timer and per record, medians of
``--runs``; the machine is shared, so CPU is the steadier figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def _measure(keys: int, runs: int) -> dict[str, Any]:
    import numpy as np
    import pyarrow as pa

    import bench_timers as bt
    import keygroups
    import keygroups.runtime.subtask as subtask

    def timed(name: str, spent: list[tuple[float, float]]) -> Any:
        original = getattr(subtask, name)

        def run(*args: Any, **kwargs: Any) -> Any:
            c, t = time.process_time(), time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                spent.append((time.process_time() - c, time.perf_counter() - t))

        setattr(subtask, name, run)
        return original

    table = pa.table({"key": np.arange(keys, dtype=np.int64), "t": np.arange(keys, dtype=np.int64) + 1000})
    fire: list[tuple[float, float]] = []
    records: list[tuple[float, float]] = []
    for _ in range(runs):
        with tempfile.TemporaryDirectory() as location, tempfile.TemporaryDirectory() as local:
            bt._micro_batch(location, local, "heap", bt.RegisterTimer(), table, 0)
            spent: list[tuple[float, float]] = []
            original = timed("_fire_timers", spent)
            report, _ = bt._micro_batch(location, local, "heap", bt.RegisterTimer(), None, 10**12)
            subtask._fire_timers = original
            fired = report["timers"]["event-time"]["fired"] if "timers" in report else keys
            if fired != keys:
                raise SystemExit(f"{fired} timers fired, expected {keys}")
            fire.append(spent[-1])
        with tempfile.TemporaryDirectory() as location, tempfile.TemporaryDirectory() as local:
            bt._micro_batch(location, local, "heap", bt.WriteValue(), table, 0)
            spent = []
            original = timed("_process", spent)
            bt._micro_batch(location, local, "heap", bt.ClearValue(), table, 0)
            subtask._process = original
            records.append(spent[-1])
    return {"keygroups": keygroups.__file__,
            "fire": [statistics.median(x[i] for x in fire) / keys * 1e6 for i in (0, 1)],
            "records": [statistics.median(x[i] for x in records) / keys * 1e6 for i in (0, 1)],
            "fire_runs": [x[0] / keys * 1e6 for x in fire], "records_runs": [x[0] / keys * 1e6 for x in records]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--before-python", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_measure(args.keys, args.runs)))
        return 0
    builds = {"this build": (sys.executable, dict(os.environ))}
    if args.before_python:
        builds["before"] = (args.before_python, {k: v for k, v in os.environ.items()
                                                 if k not in ("PYTHONPATH", "VIRTUAL_ENV")})
    print(f"{args.keys:,} keys, one event-time timer each, heap, parallelism 1, medians of {args.runs}; load "
          f"{os.getloadavg()[0]:.1f} (2 cores, shared machine)", flush=True)
    results = {}
    for name, (python, env) in builds.items():
        done = subprocess.run([python, os.path.abspath(__file__), "--child", "--keys", str(args.keys), "--runs",
                               str(args.runs)], capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
        if done.returncode:
            raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
        results[name] = r = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"  {name} [{r['keygroups']}]: fire CPU µs/timer per run {[round(x, 2) for x in r['fire_runs']]}, "
              f"records CPU µs/record per run {[round(x, 2) for x in r['records_runs']]}; load "
              f"{os.getloadavg()[0]:.1f}", flush=True)
    print(f"\n{'build':<12}{'fire CPU µs/timer':>19}{'wall':>8}{'records CPU µs/rec':>20}{'wall':>8}"
          f"{'timer / record (CPU)':>22}")
    for name, r in results.items():
        print(f"{name:<12}{r['fire'][0]:>19.2f}{r['fire'][1]:>8.2f}{r['records'][0]:>20.2f}{r['records'][1]:>8.2f}"
              f"{r['fire'][0] / r['records'][0]:>21.2f}x")
    if "before" in results:
        ratio = results["this build"]["fire"][0] / results["before"]["fire"][0]
        print(f"firing, this build / before (CPU): {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
