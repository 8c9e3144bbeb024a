"""The fault campaign at full size (issue 12, item 7): prints trials, kills by point, concurrent commits refused,
damaged files detected or harmless, and lost or duplicated updates (the campaign's code is tests/fault_campaign.py;
tests/test_fault_campaign.py runs a few trials of it).

    PYTHONPATH=src python benchmarks/bench_fault_campaign.py [--trials 50] [--spark-trials 3] [--seed 0]

Driver and task trials alternate heap and RocksDB; ``--spark-trials`` driver trials run on local Spark (slow: a
JVM per driver process). Exits 1 if any trial lost or duplicated an update, or failed otherwise.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

from fault_campaign import (  # noqa: E402  (the campaign lives beside the tests that run it small)
    concurrent_trial,
    corruption_baseline,
    corruption_trial,
    driver_kill_trial,
    make_workload,
    quiet_logs,
    summarize,
    task_kill_trial,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=50, help="trials per kind (driver, task, concurrent, corruption)")
    parser.add_argument("--spark-trials", type=int, default=3, help="driver-kill trials on local Spark")
    parser.add_argument("--seed", type=int, default=0, help="first seed; trial i uses seed + i")
    args = parser.parse_args()
    started = time.perf_counter()
    trials = []
    with tempfile.TemporaryDirectory(prefix="kg-faults-") as tmp, quiet_logs():
        workload = make_workload(tmp)
        seeds = range(args.seed, args.seed + args.trials)
        for i, seed in enumerate(seeds):
            backend = ("heap", "rocksdb")[i % 2]
            trials.append(driver_kill_trial(workload, tmp, seed, backend=backend))
            trials.append(task_kill_trial(workload, tmp, seed, backend=backend))
            trials.append(concurrent_trial(tmp, seed, backend=backend))
            print(f"  {i + 1}/{args.trials} rounds, {time.perf_counter() - started:.0f} s", file=sys.stderr)
        for i, seed in enumerate(range(args.seed, args.seed + args.spark_trials)):
            trials.append(driver_kill_trial(workload, tmp, 10_000 + seed, backend=("heap", "rocksdb")[i % 2],
                                            spark=True, timeout=600))
            print(f"  spark {i + 1}/{args.spark_trials}, {time.perf_counter() - started:.0f} s", file=sys.stderr)
        baseline = corruption_baseline(workload, tmp)
        trials += [corruption_trial(workload, baseline, tmp, seed) for seed in seeds]
    counts = summarize(trials)
    print(f"== fault campaign: {len(trials)} trials in {time.perf_counter() - started:.0f} s")
    for name, value in counts.items():
        if name == "failed trials":
            continue
        if isinstance(value, dict):
            print(f"{name}:")
            for k, v in value.items():
                print(f"  {k:<48} {v}")
        else:
            print(f"{name:<50} {value}")
    print(f"{'failed trials':<50} {len(counts['failed trials'])}")
    for failed in counts["failed trials"]:
        print(json.dumps(failed, default=str)[:3000])
    return 1 if counts["failed trials"] or counts["lost updates"] or counts["duplicated updates"] else 0


if __name__ == "__main__":
    sys.exit(main())
