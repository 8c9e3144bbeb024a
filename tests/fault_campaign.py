"""The fault campaign (issue 12, item 7): real processes killed at random points, concurrent drivers and damaged
checkpoint files, each trial checked for exactly-once state and outputs against a plain Python reference.

One module, two sizes: tests/test_fault_campaign.py runs a few trials of each kind with fixed seeds,
benchmarks/bench_fault_campaign.py runs 50+ and prints the counts. Kill points live here, in the harness processes
(``python fault_campaign.py driver|worker|concurrent-driver CONFIG``), never in the package: the harness patches the
package's own functions in its own process only.

* **Driver kills** (:func:`driver_kill_trial`): a driver process runs the shop job (:mod:`shop_runtime`; or on local
  Spark) batch after batch and SIGKILLs itself at a chosen point: in a source subtask, in the user function (a task
  in the driver's process), while a file is written, after every report and before the commit, with the temporary
  ``_metadata`` written but not linked, linked but not synced, after the commit before the output is delivered, or
  in the middle of retention. It is restarted (sometimes at another parallelism) until the job is done. The sink is
  exactly-once the way a ``foreachBatch`` sink is: each committed checkpoint's output is written under its id, and a
  restarted driver first delivers the retained checkpoints it has not delivered.
* **Task kills** (:func:`task_kill_trial`): the driver survives; its keyed subtasks run in a worker process that dies
  (``os._exit``, SIGKILL or an exception) at a chosen record of a first attempt, or succeeds with its report thrown
  away; the driver retries the task in a new worker.
* **Concurrent drivers** (:func:`concurrent_trial`): two driver processes on one location, each with its own input
  batches, commit with automatic ids; a refused commit (ConcurrentCommitError) is retried as a new batch.
* **Corruption** (:func:`corruption_trial`): one random file of a real checkpoint directory flipped, truncated or
  deleted; ``keygroups verify``, replaying each retained checkpoint's output and resuming the job must detect it or be
  unaffected: never a crash, never a silently different result.

Every trial returns a :class:`Trial`; :func:`summarize` adds them up into the campaign's counts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pathlib
import pickle
import random
import shutil
import signal
import struct
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from keygroups._parquet import read_parquet
import keygroups as kg
from keygroups.checkpoint import CheckpointStorage
from keygroups.checkpoint import storage as storage_module
from keygroups.cli import main as keygroups_main
from keygroups.cli import shop
from keygroups.errors import CheckpointNotFoundError, ConcurrentCommitError, KeyGroupsError
from keygroups.runtime import begin_batch, commit_batch
from keygroups.runtime.functions import KeyedProcessFunction
from state_views import latest_values
from keygroups.runtime.report import SubtaskReport
from keygroups.runtime.subtask import run_keyed_subtask
from keygroups.serializers import Int64Serializer
from keygroups.sources import write_partitioned_log
from keygroups.state import ValueStateDescriptor
from shop_runtime import MAX_PARALLELISM, final_states, read_outputs, rows, run_batch

HERE = pathlib.Path(__file__).resolve().parent
#: Where this process imports keygroups from (the installed package, or a source tree with its compiled core):
#: the harness processes import the very same one.
PACKAGE_ROOT = pathlib.Path(kg.__file__).resolve().parent.parent

#: Where a driver process can be killed. "task" and "file-write" are during tasks (subtasks run in the driver's
#: process without Spark); "publish-tmp" and "publish-linked" are inside the exclusive ``_metadata`` publish.
DRIVER_POINTS = ("source", "task", "file-write", "reported", "publish-tmp", "publish-linked", "committed",
                 "retention")
#: The points of a driver on Spark ("task": a Spark task kills the driver at a chosen record).
SPARK_DRIVER_POINTS = ("task", "reported", "publish-tmp", "publish-linked", "committed", "retention")
#: How a task attempt dies in a task-kill trial ("discarded": it succeeds, but its report never reaches the driver).
TASK_MODES = ("exit", "sigkill", "raise", "discarded")
DAMAGES = ("flip", "truncate", "delete")


# ---- the workload -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Workload:
    """The shop job's input: a partitioned log, and the reference (final state per user, every order)."""

    log_dir: str
    n_events: int
    expected_state: dict[str, shop.UserState]
    expected_orders: list[tuple]


def make_workload(directory: str | os.PathLike[str], *, n_events: int = 1500, n_users: int = 120,
                  partitions: int = 4, seed: int = 12) -> Workload:
    """Write the log under ``directory`` and compute the reference with plain dicts (shop.reference)."""
    events = shop.generate_events(n_events, n_users, partitions=partitions, seed=seed)
    log_dir = os.path.join(os.fspath(directory), "log")
    write_partitioned_log(log_dir, events)
    state, orders = shop.reference(events)
    return Workload(log_dir, n_events, state, sorted(orders))


def random_schedule(rng: random.Random, workload: Workload, batches: int, max_p: int = 4) -> list[list[Any]]:
    """``batches`` entries ``[parallelism, max_records_per_subtask]``, one per checkpoint id (1, 2, ...); the last
    reads whatever is left (None), so the job ends with the log consumed."""
    per_batch = workload.n_events // batches
    out: list[list[Any]] = []
    for i in range(batches):
        p = rng.randint(1, max_p)
        out.append([p, None if i == batches - 1 else max(10, rng.randint(per_batch // 2, per_batch) // p)])
    return out


# ---- the exactly-once sink ----------------------------------------------------------------------------------------

def deliver(sink: str, checkpoint_id: int, records: int, orders: list[tuple], tag: str = "") -> None:
    """Write one committed checkpoint's output to the sink under its id (atomically; the same id again overwrites:
    delivering is idempotent)."""
    os.makedirs(sink, exist_ok=True)
    path = os.path.join(sink, f"{checkpoint_id:06d}.json")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"checkpoint_id": checkpoint_id, "records": records, "orders": orders, "tag": tag}, f)
    os.replace(tmp, path)


def delivered(sink: str) -> dict[int, dict[str, Any]]:
    """What the sink holds, by checkpoint id."""
    out = {}
    for name in sorted(os.listdir(sink)) if os.path.isdir(sink) else []:
        if name.endswith(".json"):
            with open(os.path.join(sink, name), encoding="utf-8") as f:
                entry = json.load(f)
            entry["orders"] = [tuple(o) for o in entry["orders"]]
            out[entry["checkpoint_id"]] = entry
    return out


def source_records(metadata: Any) -> int:
    """How many records the sources of a committed checkpoint read (its reports say)."""
    from keygroups.runtime.properties import BatchProperties

    return sum(r.records for r in BatchProperties.of(metadata).source_reports)


def deliver_pending(storage: CheckpointStorage, sink: str) -> None:
    """A restarted driver first delivers every retained checkpoint it committed but had not delivered (it died in
    between); the output of the latest complete checkpoint is always retained."""
    done = delivered(sink)
    for cid in storage.checkpoint_ids():
        if cid not in done:
            md = storage.load(cid)
            deliver(sink, cid, source_records(md), rows(read_outputs(storage, md)))


# ---- kill points, in a harness process ----------------------------------------------------------------------------

class Killer:
    """SIGKILLs this process at the ``nth`` time ``point`` is reached in a batch whose checkpoint id is at least
    ``after`` (counting on into later batches, so a kill planned at a rare point still lands when it can)."""

    def __init__(self, point: str | None, after: int = 1, nth: int = 1) -> None:
        self.point, self.after, self.nth = point, after, nth
        self.checkpoint_id = 0
        self.seen = 0

    def at(self, point: str) -> None:
        if point == self.point and self.checkpoint_id >= self.after:
            self.seen += 1
            if self.seen >= self.nth:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    def install(self) -> None:
        """Patch the package's functions in this process so that the kill point is reached where it is named."""
        at = self.at
        if self.point == "task":
            process = shop.CartFunction.process_element

            def process_element(function: Any, event: Any, context: Any) -> Any:
                at("task")
                return process(function, event, context)

            shop.CartFunction.process_element = process_element  # type: ignore[method-assign]
        elif self.point == "file-write":
            open_write = CheckpointStorage.open_write

            def open_write_then_die(storage: CheckpointStorage, relpath: str) -> Any:
                f = open_write(storage, relpath)
                close = f.close

                def close_or_die() -> None:
                    at("file-write")   # before the last buffer is flushed: the file stays partly written
                    close()

                f.close = close_or_die  # type: ignore[method-assign]
                return f

            CheckpointStorage.open_write = open_write_then_die  # type: ignore[method-assign]
        elif self.point in ("publish-tmp", "publish-linked"):
            link = os.link

            def link_then_die(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
                publishing = os.fspath(dst).endswith(f"/{storage_module.METADATA_NAME}")
                if publishing:
                    at("publish-tmp")
                link(src, dst, *args, **kwargs)
                if publishing:
                    at("publish-linked")

            os.link = link_then_die
        elif self.point == "retention":
            local = storage_module._LocalFS
            for name in ("rmtree", "remove"):
                def removal(fs: Any, rel: str, _do: Callable[..., None] = getattr(local, name)) -> None:
                    _do(fs, rel)
                    at("retention")

                setattr(local, name, removal)


# ---- driver kills -------------------------------------------------------------------------------------------------

def driver_main(config: dict[str, Any]) -> int:
    """A driver process: run the schedule's batches from wherever the location stands, delivering each committed
    checkpoint's output to the sink; killed by the harness at ``config["kill"]`` (None: never)."""
    kill = Killer(**config["kill"]) if config.get("kill") else Killer(None)
    kill.install()
    storage = CheckpointStorage(config["location"], retain=config["retain"])
    sink, schedule = config["sink"], config["schedule"]
    storage.finish_interrupted_commit()   # a batch claimed but not yet published when the driver died counts too
    deliver_pending(storage, sink)
    spark_job = _spark_job(config, kill) if config.get("spark") else None
    while True:
        latest = storage.latest()
        cid = latest.checkpoint_id + 1 if latest is not None else 1
        if cid > len(schedule):
            return 0
        kill.checkpoint_id = cid
        parallelism, max_records = schedule[cid - 1]
        if spark_job is not None:
            job, spark = spark_job
            result = job.run_source_batch(spark, config["log_dir"], parallelism=parallelism,
                                          record_schema=shop.EVENT_SCHEMA, max_records_per_subtask=max_records)
            metadata, orders = result.metadata, sorted(tuple(r) for r in result.output.collect())
        else:
            metadata, table, _ = run_batch(config["location"], config["log_dir"], shop.CartFunction(), parallelism,
                                           max_records, backend=config["backend"], retain=config["retain"],
                                           local_dir=config["local_dir"], at=kill.at)
            orders = rows(table)
        kill.at("committed")
        deliver(sink, metadata.checkpoint_id, source_records(metadata), orders)


class KillsDriverAtRecord(shop.CartFunction):
    """The cart function, run by Spark's Python workers, that SIGKILLs the driver process at its ``record``-th
    record of a batch whose id is at least ``after`` (a driver killed while its tasks run)."""

    def __init__(self, driver_pid: int, after: int, record: int) -> None:
        self.driver_pid, self.after, self.record = driver_pid, after, record

    def open(self, context: Any) -> None:
        super().open(context)
        self.seen = 0
        self.checkpoint_id = context.checkpoint_id

    def process_element(self, event: Any, context: Any) -> Any:
        self.seen += 1
        if self.checkpoint_id >= self.after and self.seen == self.record:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.driver_pid, signal.SIGKILL)
        return super().process_element(event, context)


def _spark_job(config: dict[str, Any], killer: Killer) -> tuple[Any, Any]:
    """A local Spark session (the tests' settings) and the shop job on it, for a driver process on Spark; the
    runner's commit reaches the "reported" kill point first."""
    from pyspark.sql import SparkSession

    import keygroups.runtime.batch as batch_module
    from keygroups.spark import KeyedJob

    commit = batch_module.commit_batch

    def commit_after_reports(*args: Any, **kwargs: Any) -> Any:
        killer.at("reported")
        return commit(*args, **kwargs)

    batch_module.commit_batch = commit_after_reports

    spark = (SparkSession.builder.master("local[2,2]").appName("keygroups-faults")
             .config("spark.ui.enabled", "false").config("spark.sql.shuffle.partitions", "4")
             .config("spark.sql.execution.arrow.pyspark.enabled", "true")
             .config("spark.sql.session.timeZone", "UTC").getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    kill = config.get("kill") or {}
    function = (KillsDriverAtRecord(os.getpid(), kill["after"], kill["nth"]) if kill.get("point") == "task"
                else shop.CartFunction())
    job = KeyedJob("carts", "user", function, output_schema=shop.ORDER_SCHEMA, max_parallelism=MAX_PARALLELISM,
                   checkpoint_location=config["location"], order_by=("_partition", "_offset"), retain=config["retain"],
                   backend=config["backend"], local_dir=config["local_dir"])
    return job, spark


@dataclass
class Trial:
    """One trial's outcome: what was injected, and whether state and outputs were exactly the reference's."""

    kind: str
    seed: int
    backend: str = "heap"
    kills: Counter[str] = field(default_factory=Counter)   # by point (driver) or mode (task)
    planned_not_reached: int = 0
    rescaled: bool = False
    refused: int = 0                  # concurrent commits refused with ConcurrentCommitError
    stale: int = 0                    # concurrent batches whose restored checkpoint the other driver removed
    damage: str = ""                  # corruption: "<how> <file kind>"
    outcome: str = "ok"               # corruption: detected | harmless; otherwise ok
    lost: int = 0                     # input records or updates missing from state and outputs
    duplicated: int = 0               # input records or updates applied twice
    problems: list[str] = field(default_factory=list)
    #: corruption: checkpoints whose output replays differently and nothing noticed (outputs carry no checksum)
    silent_output: int = 0
    #: corruption: the resumed job noticed the damage, but with a raw Python error rather than a KeyGroupsError
    raw_error: str = ""

    @property
    def passed(self) -> bool:
        return not self.problems and self.lost == 0 and self.duplicated == 0


def _env() -> dict[str, str]:
    """A harness process's environment: the package and this directory importable (Spark's workers too)."""
    paths = [str(PACKAGE_ROOT), str(HERE), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths)),
            "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}


def _run_harness(command: str, config: dict[str, Any], timeout: float, spark: bool = False
                 ) -> subprocess.CompletedProcess[str]:
    """Run ``python fault_campaign.py <command> <config>`` in its own session; whatever it leaves behind when it is
    killed (Spark's JVM and Python daemon) is stopped by the tests' kill_tree, by recorded pid."""
    from spark_cluster import kill_tree, tree_identities

    proc = subprocess.Popen([sys.executable, str(HERE / "fault_campaign.py"), command, json.dumps(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
                            start_new_session=True)
    recorded: list[Any] = []
    deadline = time.monotonic() + timeout
    try:
        if not spark:
            out, err = proc.communicate(timeout=timeout)
            return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        while proc.poll() is None and time.monotonic() < deadline:   # remember the tree before the driver dies
            recorded = list(dict.fromkeys([*recorded, *tree_identities(proc.pid)]))
            time.sleep(0.5)
        out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        kill_tree(proc, grace=2.0, recorded=recorded)


def check_shop_result(trial: Trial, workload: Workload, location: str, entries: dict[int, dict[str, Any]],
                      last_id: int) -> None:
    """Exactly once: the sink holds checkpoints 1..last_id, their sources read every input record once, their
    orders are the reference's, and the latest checkpoint's state is the reference's final state."""
    if sorted(entries) != list(range(1, last_id + 1)):
        trial.problems.append(f"the sink holds checkpoints {sorted(entries)}, expected 1..{last_id}")
    records = sum(e["records"] for e in entries.values())
    trial.lost += max(0, workload.n_events - records)
    trial.duplicated += max(0, records - workload.n_events)
    orders = Counter(o for e in entries.values() for o in e["orders"])
    expected = Counter(workload.expected_orders)
    trial.lost += sum((expected - orders).values())
    trial.duplicated += sum((orders - expected).values())
    state = final_states(location)
    if state != workload.expected_state:
        wrong = sorted(u for u in set(state) | set(workload.expected_state)
                       if state.get(u) != workload.expected_state.get(u))
        trial.problems.append(f"final state differs from the reference for {len(wrong)} users, e.g. {wrong[:3]}")


def driver_kill_trial(workload: Workload, directory: str | os.PathLike[str], seed: int, *, backend: str = "heap",
                      spark: bool = False, timeout: float = 120.0) -> Trial:
    """One driver-kill trial: 1-3 planned kills at random points, a restart after each (a rescale in some
    trials), then the exactly-once check."""
    rng = random.Random(seed)
    trial = Trial("driver-spark" if spark else "driver", seed, backend)
    root = pathlib.Path(directory) / f"driver-{seed}"
    batches = rng.randint(4, 6)
    schedule = random_schedule(rng, workload, batches)
    config: dict[str, Any] = {"location": str(root / "chk"), "log_dir": workload.log_dir, "sink": str(root / "sink"),
                              "backend": backend, "retain": 2, "local_dir": str(root / "local"), "spark": spark}
    plans = []
    for _ in range(rng.randint(1, 3)):
        point = rng.choice(SPARK_DRIVER_POINTS if spark else DRIVER_POINTS)
        nth = {"task": rng.randint(1, 40 if spark else 300), "file-write": rng.randint(1, 8), "source": rng.randint(1, 3),
               "retention": rng.randint(1, 4)}.get(point, 1)
        plans.append({"point": point, "after": rng.randint(3 if point == "retention" else 1, batches), "nth": nth})
    for plan in [*plans, None]:
        config.update(kill=plan, schedule=schedule)
        done = _run_harness("driver", config, timeout, spark=spark)
        if done.returncode == -signal.SIGKILL and plan is not None:
            trial.kills[plan["point"]] += 1
            if rng.random() < 0.5:   # the restarted driver runs the rest at other parallelisms
                trial.rescaled = True
                schedule = [[rng.randint(1, 4), m] for _, m in schedule]
            continue
        if done.returncode != 0:
            trial.problems.append(f"driver exited {done.returncode} (kill plan {plan}): {done.stderr[-2000:]}")
            return trial
        trial.planned_not_reached += plan is not None
        break
    check_shop_result(trial, workload, config["location"], delivered(config["sink"]), batches)
    return trial


# ---- task kills ---------------------------------------------------------------------------------------------------

class DiesOnce(shop.CartFunction):
    """The cart function whose first attempt of each chosen subtask dies at a chosen record: ``victims`` maps
    ``"<checkpoint id>/<subtask>"`` to ``(record, mode)``; a marker file under ``markers`` makes later attempts
    live."""

    def __init__(self, markers: str, victims: dict[str, tuple[int, str]]) -> None:
        self.markers, self.victims = markers, victims

    def open(self, context: Any) -> None:
        super().open(context)
        self.seen = 0
        self.victim = f"{context.checkpoint_id}/{context.subtask_index}"

    def process_element(self, event: Any, context: Any) -> Any:
        self.seen += 1
        record, mode = self.victims.get(self.victim, (0, ""))
        if self.seen == record and mode != "discarded":
            marker = os.path.join(self.markers, self.victim.replace("/", "-"))
            if not os.path.exists(marker):
                open(marker, "w").close()
                if mode == "exit":
                    os._exit(17)
                if mode == "sigkill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise RuntimeError(f"task {self.victim} failed at record {record}")
        return super().process_element(event, context)


def _write_message(stream: Any, obj: Any) -> None:
    data = pickle.dumps(obj)
    stream.write(struct.pack("<Q", len(data)) + data)
    stream.flush()


def _read_message(stream: Any) -> Any:
    head = stream.read(8)
    if len(head) < 8:
        raise EOFError("the other side is gone")
    (n,) = struct.unpack("<Q", head)
    data = stream.read(n)
    if len(data) < n:
        raise EOFError("the other side is gone")
    return pickle.loads(data)


def worker_main() -> int:
    """A task worker process: runs keyed subtasks sent over stdin, answers with their reports (or their error)."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        try:
            spec, index, ipc = _read_message(stdin)
        except EOFError:
            return 0
        batches = list(pa.ipc.open_stream(ipc)) if ipc else []
        try:
            _write_message(stdout, ("ok", run_keyed_subtask(spec, index, batches).to_json()))
        except Exception as e:
            _write_message(stdout, ("error", repr(e)))


class RetryingTasks:
    """Runs keyed subtasks in a worker process, as an executor would, retrying an attempt whose worker died or
    which failed (up to ``attempts`` times); counts the failures by how they showed."""

    def __init__(self, attempts: int = 3) -> None:
        self.attempts = attempts
        self.failures: Counter[str] = Counter()
        self.discard: set[str] = set()   # "<checkpoint id>/<subtask>" whose first successful report is thrown away
        self._proc: subprocess.Popen[bytes] | None = None

    def _worker(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            self._proc = subprocess.Popen([sys.executable, str(HERE / "fault_campaign.py"), "worker", "{}"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_env())
        return self._proc

    def __call__(self, spec: Any, index: int, batches: list[pa.RecordBatch]) -> SubtaskReport:
        sink = io.BytesIO()
        if batches:
            with pa.ipc.new_stream(sink, batches[0].schema) as writer:
                for b in batches:
                    writer.write_batch(b)
        for _ in range(self.attempts):
            proc = self._worker()
            try:
                _write_message(proc.stdin, (spec, index, sink.getvalue()))
                status, answer = _read_message(proc.stdout)
            except (EOFError, BrokenPipeError):
                code = proc.wait()
                self.failures["exit" if code > 0 else "sigkill"] += 1
                continue
            if status == "error":
                self.failures["raise"] += 1
                continue
            victim = f"{spec.checkpoint_id}/{index}"
            if victim in self.discard:
                self.discard.discard(victim)
                self.failures["discarded"] += 1
                continue
            return SubtaskReport.from_json(answer)
        raise RuntimeError(f"subtask {index} of checkpoint {spec.checkpoint_id} failed {self.attempts} times")

    def close(self) -> None:
        if self._proc is not None:
            self._proc.stdin.close()   # type: ignore[union-attr]
            self._proc.wait(timeout=30)


def task_kill_trial(workload: Workload, directory: str | os.PathLike[str], seed: int, *,
                    backend: str = "heap") -> Trial:
    """One task-kill trial: the driver (this process) runs the schedule; 1-3 chosen subtask attempts die at a
    chosen record (or have their report discarded) and are retried in a new worker; then the exactly-once check."""
    rng = random.Random(seed)
    trial = Trial("task", seed, backend)
    root = pathlib.Path(directory) / f"task-{seed}"
    batches = rng.randint(3, 5)
    schedule = random_schedule(rng, workload, batches)
    trial.rescaled = len({p for p, _ in schedule}) > 1
    victims: dict[str, tuple[int, str]] = {}
    for _ in range(rng.randint(1, 3)):
        cid = rng.randint(1, batches)
        victims[f"{cid}/{rng.randrange(schedule[cid - 1][0])}"] = (rng.randint(1, 60), rng.choice(TASK_MODES))
    (root / "markers").mkdir(parents=True)
    tasks = RetryingTasks()
    tasks.discard = {v for v, (_, mode) in victims.items() if mode == "discarded"}
    location, sink = str(root / "chk"), str(root / "sink")
    try:
        for parallelism, max_records in schedule:
            metadata, table, n = run_batch(location, workload.log_dir, DiesOnce(str(root / "markers"), victims),
                                           parallelism, max_records, backend=backend, retain=2,
                                           local_dir=str(root / "local"), run_subtask=tasks)
            deliver(sink, metadata.checkpoint_id, n, rows(table))
    finally:
        tasks.close()
    trial.kills = tasks.failures
    check_shop_result(trial, workload, location, delivered(sink), batches)
    return trial


# ---- concurrent drivers -------------------------------------------------------------------------------------------

TALLY = ValueStateDescriptor("sum", Int64Serializer())
TALLY_INPUT = pa.schema([("k", pa.int64()), ("v", pa.int64()), ("rid", pa.string()), ("seq", pa.int64())])
TALLY_OUTPUT = pa.schema([("k", pa.int64()), ("rid", pa.string()), ("sum", pa.int64())])
TALLY_MAX_PARALLELISM = 32


class Tally(KeyedProcessFunction):
    """A running sum per key; every record emits (key, record id, the sum after it)."""

    def open(self, context: Any) -> None:
        self.sum = context.get_state(TALLY)

    def process_element(self, record: Any, context: Any) -> Any:
        total = (self.sum.value() or 0) + record["v"]
        self.sum.update(total)
        return [(record["k"], record["rid"], total)]


def tally_batches(name: str, seed: int, batches: int, keys: int = 40, size: int = 60) -> list[pa.Table]:
    """Driver ``name``'s own input: ``batches`` tables of records with ids ``<name>-<batch>-<i>``."""
    rng = random.Random(f"{seed}-{name}")
    out = []
    for b in range(batches):
        ks = [rng.randrange(keys) for _ in range(size)]
        out.append(pa.table({"k": pa.array(ks, pa.int64()), "v": pa.array([rng.randint(1, 9) for _ in ks], pa.int64()),
                             "rid": [f"{name}-{b}-{i}" for i in range(size)],
                             "seq": pa.array(range(size), pa.int64())}, schema=TALLY_INPUT))
    return out


def concurrent_main(config: dict[str, Any]) -> int:
    """One of two concurrent drivers: commits each of its batches once, with automatic ids, retrying a batch whose
    commit another driver's commit of the same id refused; prints how many were refused."""
    storage = CheckpointStorage(config["location"], retain=config["retain"])
    rng = random.Random(f"{config['seed']}-{config['name']}-p")
    go = config["go"]
    while not os.path.exists(go):   # both drivers start their first batch together
        time.sleep(0.005)
    refused = stale = 0
    for b, table in enumerate(tally_batches(config["name"], config["seed"], config["batches"])):
        while True:
            p = rng.randint(1, 4)
            plan = begin_batch(storage, job_name="tally", max_parallelism=TALLY_MAX_PARALLELISM, parallelism=p)
            spec = plan.keyed_task(key_columns=("k",), function=pickle.dumps(Tally()), input_schema=TALLY_INPUT,
                                   output_schema=TALLY_OUTPUT, order_columns=("seq",), backend=config["backend"],
                                   local_dir=config["local_dir"])
            owners = kg.assign_operators(table.column("k"), TALLY_MAX_PARALLELISM, p)
            try:
                reports = [run_keyed_subtask(spec, i, table.filter(pa.array(owners == i)).to_batches())
                           for i in range(p)]
            except CheckpointNotFoundError:
                # the other driver committed past this plan and its retention removed the checkpoint the plan
                # restores: a lost race found before the commit (a task error, not ConcurrentCommitError)
                if storage.checkpoint_ids()[-1] <= (plan.restore_from or 0):
                    raise
                stale += 1
                continue
            try:   # read before the commit: once committed, the other driver's retention may remove them
                outputs = read_outputs_of(storage, [r.output_file for r in reports])
            except FileNotFoundError:   # it already did: this batch's id is taken, and the commit must say so
                outputs = None
            try:
                metadata = commit_batch(plan, reports, properties={"tag": f"{config['name']}-{b}"})
            except ConcurrentCommitError:
                refused += 1
                continue
            if outputs is None:
                raise AssertionError(f"checkpoint {metadata.checkpoint_id} committed files that were gone before")
            deliver(config["sink"], metadata.checkpoint_id, table.num_rows, outputs, tag=f"{config['name']}-{b}")
            break
    print(json.dumps({"refused": refused, "stale": stale}))
    return 0


def read_outputs_of(storage: CheckpointStorage, files: list[str]) -> list[tuple]:
    """The rows of output files, read before the commit that names them (the driver's own, so they are there)."""
    tables = [read_parquet(storage.read_bytes(f)) for f in files]
    return sorted(tuple(r.values()) for t in tables for r in t.to_pylist())


def tally_states(location: str | CheckpointStorage) -> dict[int, int]:
    """Each key's sum in the latest checkpoint at ``location`` (a path, or the storage itself)."""
    return latest_values(location, TALLY, TALLY_MAX_PARALLELISM, "long")


def concurrent_trial(directory: str | os.PathLike[str], seed: int, *, backend: str = "heap", batches: int = 4,
                     timeout: float = 120.0) -> Trial:
    """Two driver processes on one location, each committing its own ``batches`` batches; then: every batch is
    committed exactly once (by tag), the outputs are the running sums of the batches in commit order, and the final
    state is every record's sum."""
    rng = random.Random(seed)
    trial = Trial("concurrent", seed, backend)
    root = pathlib.Path(directory) / f"concurrent-{seed}"
    root.mkdir(parents=True)
    base = {"location": str(root / "chk"), "sink": str(root / "sink"), "seed": seed, "batches": batches,
            "retain": rng.randint(2, 3), "go": str(root / "go"), "backend": backend, "local_dir": str(root / "local")}
    procs = [subprocess.Popen([sys.executable, str(HERE / "fault_campaign.py"), "concurrent-driver",
                               json.dumps({**base, "name": name})], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=_env()) for name in ("a", "b")]
    time.sleep(1.0 + rng.random())   # both have imported everything and wait
    (root / "go").touch()
    for name, proc in zip("ab", procs):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        if proc.returncode != 0:
            trial.problems.append(f"driver {name} exited {proc.returncode}: {err[-2000:]}")
        else:
            counts = json.loads(out.strip().splitlines()[-1])
            trial.refused += counts["refused"]
            trial.stale += counts["stale"]
    entries = delivered(base["sink"])
    tags = Counter(e["tag"] for e in entries.values())
    wanted = Counter(f"{n}-{b}" for n in "ab" for b in range(batches))
    trial.lost += sum((wanted - tags).values())
    trial.duplicated += sum((tags - wanted).values())
    if sorted(entries) != list(range(1, len(entries) + 1)):
        trial.problems.append(f"the sink holds checkpoints {sorted(entries)}: not 1..{len(entries)}")
    inputs = {f"{n}-{b}": t for n in "ab" for b, t in enumerate(tally_batches(n, seed, batches))}
    sums: dict[int, int] = {}
    expected = []
    for cid in sorted(entries):
        if entries[cid]["tag"] not in inputs:
            continue
        for r in inputs[entries[cid]["tag"]].to_pylist():
            sums[r["k"]] = sums.get(r["k"], 0) + r["v"]
            expected.append((r["k"], r["rid"], sums[r["k"]]))
    got = [o for cid in sorted(entries) for o in entries[cid]["orders"]]
    if sorted(got) != sorted(expected):
        trial.problems.append(f"outputs differ from the reference replayed in commit order: "
                              f"{len(set(expected) - set(got))} missing, {len(set(got) - set(expected))} unexpected")
    if not trial.problems and tally_states(base["location"]) != sums:
        trial.problems.append("the final state differs from the sums of every committed record")
    return trial


# ---- corruption ---------------------------------------------------------------------------------------------------

def corruption_baseline(workload: Workload, directory: str | os.PathLike[str], *, backend: str = "heap",
                        seed: int = 5) -> dict[str, Any]:
    """A real checkpoint directory to damage: the shop job's first batches (incremental chains, a rescale, the
    files of a retried task attempt and of a batch that never committed), their delivered outputs, and the schedule
    that finishes the job."""
    rng = random.Random(seed)
    root = pathlib.Path(directory) / "corruption-baseline"
    location, sink = str(root / "chk"), str(root / "sink")
    schedule = random_schedule(rng, workload, 6)
    for i, (p, m) in enumerate(schedule[:4]):
        metadata, table, n = run_batch(location, workload.log_dir, shop.CartFunction(), p, m, backend=backend,
                                       retain=3, retry_subtasks=i == 2, local_dir=str(root / "local"))
        deliver(sink, metadata.checkpoint_id, n, rows(table))

    class NeverCommitted(Exception):
        pass

    def die(point: str) -> None:
        if point == "reported":
            raise NeverCommitted()

    with contextlib.suppress(NeverCommitted):   # a batch whose driver died before the commit: files, no _metadata
        run_batch(location, workload.log_dir, shop.CartFunction(), *schedule[4], backend=backend, retain=3, at=die)
    return {"root": str(root), "location": location, "sink": sink, "schedule": schedule, "backend": backend}


def _file_kind(relpath: str, referenced: set[str]) -> str:
    name = relpath.rsplit("/", 1)[-1]
    kind = ("metadata" if name == storage_module.METADATA_NAME else
            next((k for k in ("keyed", "operator", "output", "input") if name.startswith(k)), "other"))
    return kind if relpath in referenced or kind == "metadata" else f"unreferenced {kind}"


def _damage(path: pathlib.Path, how: str, rng: random.Random) -> None:
    size = path.stat().st_size
    if how == "delete" or (size == 0 and how == "flip"):
        path.unlink()
    elif how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(rng.randrange(size) if size else 0)
    else:
        data = bytearray(path.read_bytes())
        data[rng.randrange(size)] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))


def _verify(location: str, checkpoint_id: int) -> int:
    """``keygroups verify`` of one checkpoint, in this process (what the command exits with)."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return keygroups_main(["verify", location, "--checkpoint", str(checkpoint_id)])


def corruption_trial(workload: Workload, baseline: dict[str, Any], directory: str | os.PathLike[str],
                     seed: int) -> Trial:
    """Damage one random file of a copy of the baseline, then: verify every complete checkpoint, replay each one's
    output, resume the job to the end. Detected (verify exits non-zero, or a KeyGroupsError on use) or harmless
    (every result the reference's); a silently different result or another exception is a problem."""
    rng = random.Random(seed)
    trial = Trial("corruption", seed, baseline["backend"])
    root = pathlib.Path(directory) / f"corruption-{seed}"
    shutil.copytree(baseline["root"], root)
    location, sink = str(root / "chk"), str(root / "sink")
    storage = CheckpointStorage(location, retain=3)
    referenced: set[str] = set()
    for cid in storage.checkpoint_ids():
        md = storage.load(cid)
        referenced |= {*md.files(), *md.outputs, *md.inputs}
    files = sorted(p.relative_to(location).as_posix() for p in pathlib.Path(location).rglob("*") if p.is_file())
    victim = rng.choice(files)
    how = rng.choice(DAMAGES)
    trial.damage = f"{how} {_file_kind(victim, referenced)}"
    _damage(pathlib.Path(location) / victim, how, rng)
    detected: list[str] = []
    try:
        for cid in storage.checkpoint_ids():
            code = _verify(location, cid)
            if code != 0:
                detected.append(f"verify {cid} exit {code}")
    except Exception as e:   # the command must answer with an exit code, whatever it reads
        trial.problems.append(f"verify crashed: {e!r}")
    state_file = trial.damage.split(" ", 1)[1] in ("keyed", "operator", "metadata")
    if state_file and trial.damage != "delete metadata" and not any(d.startswith("verify") for d in detected):
        trial.problems.append("keygroups verify missed damage to a state file a checkpoint references")
    entries = delivered(sink)
    for cid in storage.checkpoint_ids():   # a replayed batch answers with its committed output
        try:
            replayed = rows(read_outputs(storage, storage.load(cid)))
        except KeyGroupsError as e:
            detected.append(f"replay {cid}: {type(e).__name__}")
            continue
        except (OSError, ValueError, pa.ArrowException) as e:   # the Parquet reader noticed, not we
            detected.append(f"replay {cid}: parquet {type(e).__name__}")
            continue
        if replayed != entries.get(cid, {}).get("orders"):
            trial.silent_output += 1
    try:
        while True:
            latest = storage.latest()
            cid = latest.checkpoint_id + 1 if latest is not None else 1
            if cid > len(baseline["schedule"]):
                break
            metadata, table, n = run_batch(location, workload.log_dir, shop.CartFunction(),
                                           *baseline["schedule"][cid - 1], backend=baseline["backend"], retain=3,
                                           local_dir=str(root / "local"))
            deliver(sink, metadata.checkpoint_id, n, rows(table))
    except KeyGroupsError as e:
        detected.append(f"resume: {type(e).__name__}")
    except Exception as e:   # noticed, but as a raw Python error instead of CorruptSnapshotError: a finding
        detected.append(f"resume: {type(e).__name__}")
        trial.raw_error = f"{type(e).__name__} on resume after {trial.damage}: {e}"[:400]
    else:
        result = Trial("corruption", seed)
        check_shop_result(result, workload, location, delivered(sink), len(baseline["schedule"]))
        if not result.passed:
            trial.problems.append(f"the resumed job silently differs: lost {result.lost}, duplicated "
                                  f"{result.duplicated}, {result.problems}")
    trial.outcome = "detected" if detected else "silent output" if trial.silent_output else "harmless"
    if trial.problems:
        trial.problems.insert(0, f"after {trial.damage} {victim}:")
    return trial


# ---- the counts ---------------------------------------------------------------------------------------------------

def summarize(trials: list[Trial]) -> dict[str, Any]:
    """The campaign's counts: trials by kind, kills by point, concurrent commits refused, damaged files detected or
    harmless (by damage), lost and duplicated updates, failed trials."""
    kills: Counter[str] = Counter()
    for t in trials:
        kills.update({f"{t.kind}:{p}": n for p, n in t.kills.items()})
    corruption = Counter(f"{t.outcome}: {t.damage}" for t in trials if t.kind == "corruption")
    return {
        "trials": dict(Counter(t.kind for t in trials)),
        "kills": dict(sorted(kills.items())),
        "planned kills not reached": sum(t.planned_not_reached for t in trials),
        "trials with a rescale": sum(t.rescaled for t in trials),
        "concurrent commits refused": sum(t.refused for t in trials),
        "concurrent plans gone stale (CheckpointNotFoundError in a task)": sum(t.stale for t in trials),
        "corrupted files detected": sum(t.outcome == "detected" for t in trials if t.kind == "corruption"),
        "corrupted files harmless": sum(t.outcome == "harmless" for t in trials if t.kind == "corruption"),
        "corruption outcomes": dict(sorted(corruption.items())),
        "outputs replayed silently different": sum(t.silent_output for t in trials),
        "raw errors on resume (not CorruptSnapshotError)": Counter(t.raw_error.split(" after ")[0] + " after "
                                                                    + t.damage for t in trials if t.raw_error),
        "lost updates": sum(t.lost for t in trials),
        "duplicated updates": sum(t.duplicated for t in trials),
        "failed trials": [trial_record(t) for t in trials if not t.passed],
    }


def trial_record(trial: Trial) -> dict[str, Any]:
    """A trial as plain JSON values, field by field (``dataclasses.asdict`` rebuilds a Counter from its items, which
    makes its keys (point, count) tuples that ``json.dumps`` refuses)."""
    record: dict[str, Any] = {}
    for f in dataclasses.fields(trial):
        value = getattr(trial, f.name)
        record[f.name] = dict(value) if isinstance(value, Counter) else list(value) if isinstance(value, list) \
            else value
    return record


def main(argv: list[str]) -> int:
    command, config = argv[0], json.loads(argv[1])
    if command == "driver":
        return driver_main(config)
    if command == "worker":
        return worker_main()
    if command == "concurrent-driver":
        return concurrent_main(config)
    raise SystemExit(f"unknown command {command!r}; allowed: driver, worker, concurrent-driver")


@contextlib.contextmanager
def quiet_logs() -> Iterator[None]:
    """Retention warnings (e.g. an unreadable _metadata while shared files are cleaned) are expected here."""
    import logging

    logger = logging.getLogger("keygroups")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


if __name__ == "__main__":
    import fault_campaign   # classes pickled by the harness are found under this name, not __main__

    sys.exit(fault_campaign.main(sys.argv[1:]))
