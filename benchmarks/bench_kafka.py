"""Kafka beside the file log, same records, same run: records per second a source subtask reads (from the broker,
or from its log partitions) and stages for the keyed stage, and a whole batch of the shop job into its keyed state.

    PYTHONPATH=src python benchmarks/bench_kafka.py [--events 400000] [--partitions 4] [--parallelism 2] [--runs 3]

The same events (the demo's shop events, JSON objects of six fields) go to a partitioned log and to a topic of a
tansu broker on 127.0.0.1 (in memory), partition for partition. Then, interleaved, ``--runs`` times each:

* **source subtask**: one batch's source subtasks (``run_source_subtask``: restore the positions, read every
  record of the subtask's partitions, decode them against the schema, stage them as Parquet, snapshot the new
  positions), each timed on its own — wall time, this process's CPU time (librdkafka's threads included) and, for
  Kafka, the broker's CPU time;
* **whole batch**: the shop job's batch through the driver the Spark job uses (tests/shop_runtime.py, subtasks in
  this process, no Spark): sources, placement by key group, the keyed subtasks, the commit.

Both sources must give the reference's orders before any figure is printed. Medians of the runs; the machine is
shared, so CPU time is the steadier figure.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import resource
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

from keygroups.checkpoint import CheckpointStorage  # noqa: E402
from keygroups.cli import shop  # noqa: E402
from keygroups.runtime import begin_batch  # noqa: E402
from keygroups.runtime.source import run_source_subtask  # noqa: E402
from keygroups.sources import KafkaSource, LocalKafkaBroker, produce_json, write_partitioned_log  # noqa: E402
from shop_runtime import rows, run_batch  # noqa: E402


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (from /proc)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def source_stage(source: object, location: str, parallelism: int, broker_pid: int | None) -> list[dict]:
    """One batch's source subtasks from the start of the input, each timed."""
    storage = CheckpointStorage(location)
    plan = begin_batch(storage, job_name="bench", max_parallelism=128, parallelism=parallelism)
    spec = plan.source_task(source, record_schema=shop.EVENT_SCHEMA)
    out = []
    for i in range(parallelism):
        wall, cpu = time.perf_counter(), cpu_seconds()
        broker = process_cpu_seconds(broker_pid) if broker_pid else 0.0
        report = run_source_subtask(spec, i)
        out.append({"records": report.records, "wall": time.perf_counter() - wall, "cpu": cpu_seconds() - cpu,
                    "broker": (process_cpu_seconds(broker_pid) - broker) if broker_pid else 0.0})
    return out


def whole_batch(source: object, location: str, parallelism: int, broker_pid: int | None) -> dict:
    wall, cpu = time.perf_counter(), cpu_seconds()
    broker = process_cpu_seconds(broker_pid) if broker_pid else 0.0
    _, table, n = run_batch(location, source, shop.CartFunction(), parallelism, None, max_parallelism=128)
    return {"records": n, "wall": time.perf_counter() - wall, "cpu": cpu_seconds() - cpu,
            "broker": (process_cpu_seconds(broker_pid) - broker) if broker_pid else 0.0, "orders": rows(table)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=400_000)
    parser.add_argument("--users", type=int, default=20_000)
    parser.add_argument("--partitions", type=int, default=4)
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    events = shop.generate_events(args.events, args.users, args.partitions, seed=3)
    _, expected_orders = shop.reference(events)
    with tempfile.TemporaryDirectory(prefix="kg-bench-kafka-") as tmp, LocalKafkaBroker() as broker:
        log_dir = os.path.join(tmp, "log")
        write_partitioned_log(log_dir, events)
        broker.create_topic("events", args.partitions)
        started = time.perf_counter()
        for partition, records in events.items():
            produce_json(broker.bootstrap_servers, "events", records, partition=partition, key=lambda r: r["user"],
                         options={"linger.ms": 20, "batch.size": 1_000_000})
        produced = time.perf_counter() - started
        kafka = KafkaSource("events", bootstrap_servers=broker.bootstrap_servers)
        sources = {"file log": (log_dir, None), "kafka (tansu)": (kafka, broker.pid)}
        stage: dict[str, list[dict]] = {k: [] for k in sources}
        batch: dict[str, list[dict]] = {k: [] for k in sources}
        for run in range(args.runs):
            for label, (source, pid) in sources.items():
                stage[label] += source_stage(source, os.path.join(tmp, f"s-{label[:4]}-{run}"), args.parallelism,
                                             pid)
            for label, (source, pid) in sources.items():
                batch[label].append(whole_batch(source, os.path.join(tmp, f"b-{label[:4]}-{run}"),
                                                args.parallelism, pid))
        for label, runs in batch.items():
            assert all(r["records"] == args.events for r in runs), (label, [r["records"] for r in runs])
            assert all(sorted(r["orders"]) == sorted(expected_orders) for r in runs), f"{label}: orders differ"
    print(f"== Kafka source beside the file log: {args.events:,} shop events (JSON, 6 fields) in {args.partitions} "
          f"partitions, parallelism {args.parallelism}, medians of {args.runs} runs (wall time on a shared "
          f"machine; CPU time of this process, librdkafka's threads included; the broker's CPU apart)")
    print(f"   (writing the topic took {produced:.1f} s: {args.events / produced:,.0f} records/s with one producer)")
    print(f"\n{'source subtask (read, decode, stage)':<40} {'records/s/subtask':>18} {'CPU us/record':>14} "
          f"{'broker CPU us/rec':>18} {'vs log':>8}")
    base = None
    for label, runs in stage.items():
        rate = statistics.median(r["records"] / r["wall"] for r in runs)
        cpu = statistics.median(r["cpu"] / r["records"] for r in runs) * 1e6
        brk = statistics.median(r["broker"] / r["records"] for r in runs) * 1e6
        base = base or rate
        print(f"{label:<40} {rate:>18,.0f} {cpu:>14.2f} {brk:>18.2f} {rate / base:>7.2f}x")
    print(f"\n{'whole batch into the keyed job':<40} {'records/s':>18} {'CPU us/record':>14} "
          f"{'broker CPU us/rec':>18} {'vs log':>8}")
    base = None
    for label, runs in batch.items():
        rate = statistics.median(r["records"] / r["wall"] for r in runs)
        cpu = statistics.median(r["cpu"] / r["records"] for r in runs) * 1e6
        brk = statistics.median(r["broker"] / r["records"] for r in runs) * 1e6
        base = base or rate
        print(f"{label:<40} {rate:>18,.0f} {cpu:>14.2f} {brk:>18.2f} {rate / base:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
