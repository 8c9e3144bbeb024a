"""The Kafka fault campaign at full size (issue 35): the shop job reading a Kafka topic while its driver process,
its Python workers (source and keyed subtasks) and the broker are killed; prints trials, kills by point, and lost or
duplicated updates (the campaign's code is tests/kafka_campaign.py; tests/test_kafka_campaign.py runs one trial of
each kind).

    PYTHONPATH=src python benchmarks/bench_kafka_campaign.py [--trials 20] [--seed 0]

Starts a SeaweedFS S3 server and a tansu broker keeping its topics there (both on 127.0.0.1), so that the killed
broker comes back with every record. Trials alternate heap and RocksDB. Exits 1 if any trial lost or duplicated an
update, failed otherwise, or the campaign killed fewer than ``--min-kills`` processes.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

from fault_campaign import quiet_logs, summarize  # noqa: E402  (the campaign lives beside the tests)
from kafka_campaign import (  # noqa: E402
    broker_kill_trial,
    campaign_broker,
    driver_kill_trial,
    make_workload,
    worker_kill_trial,
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="trials per kind (driver, worker, broker)")
    parser.add_argument("--seed", type=int, default=0, help="first seed; trial i uses seed + i")
    parser.add_argument("--min-kills", type=int, default=50, help="fail unless at least this many kills landed")
    args = parser.parse_args()
    started = time.perf_counter()
    trials = []
    with tempfile.TemporaryDirectory(prefix="kg-kafka-faults-") as tmp, quiet_logs(), campaign_broker() as broker:
        workload = make_workload(broker)
        for i, seed in enumerate(range(args.seed, args.seed + args.trials)):
            backend = ("heap", "rocksdb")[i % 2]
            trials.append(driver_kill_trial(workload, tmp, seed, backend=backend))
            trials.append(worker_kill_trial(workload, tmp, seed, backend=backend))
            trials.append(broker_kill_trial(workload, broker, tmp, seed, backend=backend))
            for t in trials[-3:]:
                if not t.passed:
                    print(f"  FAILED {t.kind} seed {t.seed} ({t.backend}): lost {t.lost}, duplicated {t.duplicated}, "
                          f"kills {dict(t.kills)}, {str(t.problems)[:1500]}", file=sys.stderr)
            kills = sum(sum(t.kills.values()) for t in trials)
            print(f"  {i + 1}/{args.trials} rounds, {kills} kills, {time.perf_counter() - started:.0f} s",
                  file=sys.stderr)
    counts = summarize(trials)
    kills = {kind: sum(sum(t.kills.values()) for t in trials if t.kind == kind)
             for kind in ("kafka-driver", "kafka-worker", "kafka-broker")}
    print(f"== Kafka fault campaign: {len(trials)} trials, {sum(kills.values())} kills "
          f"({', '.join(f'{k}: {v}' for k, v in kills.items())}) in {time.perf_counter() - started:.0f} s "
          "(wall time on a shared machine)")
    for name in ("trials", "kills", "planned kills not reached", "trials with a rescale", "lost updates",
                 "duplicated updates"):
        value = counts[name]
        if isinstance(value, dict):
            print(f"{name}:")
            for k, v in value.items():
                print(f"  {k:<48} {v}")
        else:
            print(f"{name:<50} {value}")
    print(f"{'failed trials':<50} {len(counts['failed trials'])}")
    for failed in counts["failed trials"]:
        print(json.dumps({k: (dict((str(a), b) for a, b in v.items()) if isinstance(v, dict) else v)
                          for k, v in failed.items()}, default=str)[:3000])
    bad = counts["failed trials"] or counts["lost updates"] or counts["duplicated updates"]
    if sum(kills.values()) < args.min_kills:
        print(f"only {sum(kills.values())} kills landed, fewer than --min-kills={args.min_kills}")
        bad = True
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
