"""One micro-batch, start to end, whatever runs its subtasks: the batch's spine.

:meth:`JobDriver.run` is the one sequence every keyed batch follows, for ``KeyedJob`` on Spark and for the test
harness alike (they differ only in their :class:`BatchExecutor`):

1. **locate** where the batch starts (:func:`~keygroups.runtime.driver.locate_batch`: the restore point, the
   checkpoint id, or a replay: a complete checkpoint's output comes back, once the input is found to be the records
   it committed);
2. **read** what must be known of the input before planning: its record count (for a parallelism policy) and its
   largest event time (for a watermark), in one pass; or, for a source batch, the source subtasks' records;
3. **plan** once: the parallelism, the ranges (:meth:`~keygroups.runtime.driver.BatchStart.plan`), the function's
   states checked against the restore point's on the driver, the watermark, the task spec (with the restore point's
   ``_metadata``), the executor's placement;
4. **run** every keyed subtask through the executor, then those that had no records (idle);
5. **commit** (:func:`~keygroups.runtime.driver.commit_batch`), with retention left to a background thread; then the
   job's sink, if it has one (:mod:`keygroups.runtime.sink`: its subtasks' committables, stored in the checkpoint,
   made visible; a batch that fails before its checkpoint commits aborts them instead, and a driver's first batch
   commits the latest checkpoint's again, for a driver that died between the two commits);
6. **report** (:class:`~keygroups.runtime.report.BatchReport`).

A driver that committed the latest checkpoint keeps it (:class:`~keygroups.runtime.driver.Checkpoints`) and plans
the next batch from it: no listing, no ``_metadata`` read again, the restore point's chains and load figures worked
out once.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import queue
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import pyarrow as pa

from keygroups._hashing import KeyType
from keygroups._ranges import check_max_parallelism, check_parallelism, flink_boundaries
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.errors import ConcurrentCommitError, CorruptSnapshotError, KeyGroupsError, ReplayMismatchError
from keygroups.runtime.assignment import Assignment, AssignmentDecision, key_group_state_bytes, resolve_assignment
from keygroups.runtime.backends import BACKENDS, StateBackendName
from keygroups.runtime.driver import (
    BatchPlan,
    Checkpoints,
    DriverFence,
    StreamingBatch,
    check_key_columns,
    check_output_schema,
    check_restored_states,
    commit_batch,
    locate_batch,
    timer_summary,
)
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.runtime.properties import BatchProperties, PolicyChoice, check_user_properties
from keygroups.runtime.report import BatchReport, InputDigest, SourceReport, SubtaskReport
from keygroups.runtime.scaling import BatchFigures, ParallelismPolicy
from keygroups.runtime.sink import (
    Sink,
    SinkCommitError,
    SinkCommittable,
    check_checkpoint_output,
    check_sink,
    committables_of,
    sink_name,
)
from keygroups.runtime.source import Source, SourceTaskSpec
from keygroups.runtime.spec import KeyedTaskSpec, check_warm_heap_backends, check_write_back_batches
from keygroups.runtime.watermarks import LateRecords, WatermarkStrategy, check_late_records

log = logging.getLogger("keygroups")


@dataclass(frozen=True)
class JobOptions:
    """What a keyed job is, checked once when it is built (``KeyedJob`` and the test harness take the same
    arguments; see ``KeyedJob`` for each): its ``name`` in the checkpoints, ``key_columns``, the ``function``
    (pickled by the caller: each subtask unpickles a fresh copy), ``output_schema``, ``max_parallelism``,
    ``backend``, ``order_by``, ``timestamp_column``, ``watermark_strategy``, ``late_records``, ``allow_pickle``,
    ``local_dir``, ``warm_heap_backends``, ``write_back_batches``, ``assignment`` and ``restore_from_savepoint``;
    ``sink`` (a :class:`~keygroups.runtime.sink.Sink` its subtasks write their output to, committed with the
    checkpoint) and ``checkpoint_output`` (whether the output is also written into the checkpoint; None: only
    without a sink)."""

    name: str
    key_columns: tuple[str, ...]
    function: bytes = field(repr=False)
    output_schema: pa.Schema
    max_parallelism: int
    backend: StateBackendName = "heap"
    order_by: tuple[str, ...] = ()
    timestamp_column: str | None = None
    watermark_strategy: WatermarkStrategy | None = None
    late_records: LateRecords = "drop"
    allow_pickle: bool = False
    local_dir: str | None = None
    warm_heap_backends: int = 4
    assignment: Assignment = field(default_factory=lambda: resolve_assignment("flink"))
    restore_from_savepoint: str | None = None
    sink: Sink | None = None
    checkpoint_output: bool | None = None
    write_back_batches: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string (the job's name in its checkpoints), got {self.name!r}")
        object.__setattr__(self, "key_columns", check_key_columns(self.key_columns))
        check_output_schema(self.output_schema)
        check_max_parallelism(self.max_parallelism)
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown state backend {self.backend!r}; allowed: 'heap', 'rocksdb'")
        if self.timestamp_column is not None and (not isinstance(self.timestamp_column, str)
                                                  or not self.timestamp_column):
            raise TypeError(f"timestamp_column must be a column name (a non-empty str) or None, got "
                            f"{self.timestamp_column!r}")
        if self.watermark_strategy is not None and not isinstance(self.watermark_strategy, WatermarkStrategy):
            raise TypeError(f"watermark_strategy must be a keygroups.runtime.WatermarkStrategy, got "
                            f"{self.watermark_strategy!r}")
        if self.watermark_strategy is not None and self.timestamp_column is None:
            raise ValueError("a watermark_strategy needs the event-time column: give timestamp_column too")
        check_late_records(self.late_records)
        check_warm_heap_backends(self.warm_heap_backends)
        check_write_back_batches(self.write_back_batches, self.backend)
        check_sink(self.sink)
        if self.sink is not None:
            sink_name(self.sink)
        object.__setattr__(self, "checkpoint_output", check_checkpoint_output(self.checkpoint_output, self.sink))

    def keyed_task(self, plan: BatchPlan, input_schema: pa.Schema, key_type: KeyType,
                   watermark: int | None, sink_run_id: str = "") -> KeyedTaskSpec:
        """What every keyed subtask of ``plan`` gets (see :meth:`BatchPlan.keyed_task`); ``sink_run_id`` names this
        run of the batch to the sink's writers."""
        spec = plan.keyed_task(
            key_columns=self.key_columns, function=self.function, input_schema=input_schema,
            output_schema=self.output_schema, backend=self.backend, order_columns=self.order_by,
            timestamp_column=self.timestamp_column, allow_pickle=self.allow_pickle, local_dir=self.local_dir,
            warm_heap_backends=self.warm_heap_backends, watermark=watermark, late_records=self.late_records,
            key_type=key_type)
        if self.write_back_batches is not None:
            spec = dataclasses.replace(spec, write_back_batches=self.write_back_batches)
        if self.sink is None and self.checkpoint_output:
            return spec
        return dataclasses.replace(spec, sink=self.sink, sink_run_id=sink_run_id,
                                   checkpoint_output=bool(self.checkpoint_output))


def pickle_function(function: KeyedProcessFunction, dumps: Callable[[Any], bytes] = pickle.dumps) -> bytes:
    """``function`` pickled with ``dumps`` (a Spark job: cloudpickle, as Spark ships functions); TypeError unless it
    is a KeyedProcessFunction."""
    if not isinstance(function, KeyedProcessFunction):
        raise TypeError(f"function must be a KeyedProcessFunction instance, got {type(function).__name__}")
    return dumps(function)


@dataclass(frozen=True)
class InputFigures:
    """What the driver learns of a batch's input before planning it: its ``records`` (None: not counted) and its
    largest event time (``max_event_time``, epoch ms; None: none, or not looked for)."""

    records: int | None = None
    max_event_time: int | None = None


class BatchExecutor(Protocol):
    """What runs a batch's subtasks: Spark tasks (``keygroups.spark``), or calls in this process
    (:class:`~keygroups.runtime.local.LocalExecutor`). One executor serves one batch; the spine uses it as a
    context manager, which releases what :meth:`read_input` held (a persisted DataFrame)."""

    def __enter__(self) -> BatchExecutor: ...

    def __exit__(self, *exc_info: object) -> None: ...

    @property
    def input_schema(self) -> pa.Schema:
        """The Arrow schema the subtasks get the records in."""
        ...

    def key_type(self, key_columns: tuple[str, ...]) -> KeyType:
        """The key type of the input's key columns; raises naming the column and what is allowed when the input
        does not fit the job (checked before any Spark job)."""
        ...

    def read_input(self, *, count: bool, timestamp_column: str | None) -> InputFigures:
        """The record count (if ``count``) and the largest event time of ``timestamp_column`` (if given), in one pass
        over the input; the input stays readable for :meth:`run_keyed` without reading its source again."""
        ...

    def input_digest(self) -> InputDigest | None:
        """The input's :class:`~keygroups.runtime.report.InputDigest` (None: this executor cannot compute it)."""
        ...

    def run_sources(self, spec: SourceTaskSpec) -> list[SourceReport]:
        """Run every source subtask (:func:`keygroups.runtime.source.run_source_subtask`); their staged records are
        this batch's input from then on."""
        ...

    def prepare(self, spec: KeyedTaskSpec, plan: BatchPlan) -> None:
        """Place the input so that subtask *i* gets exactly the records of its key groups (driver work only)."""
        ...

    def run_keyed(self) -> list[SubtaskReport]:
        """Run the keyed subtasks prepared; the reports of those that ran (a subtask without records may not)."""
        ...

    def run_idle(self, subtasks: Sequence[int]) -> list[SubtaskReport]:
        """Run ``subtasks`` without records (they carry their key groups' state into the new checkpoint)."""
        ...

    def spark_seconds(self) -> float | None:
        """Spark's own time for this batch's jobs (None: not known); may be asked after the batch, once the
        executor is closed."""
        ...


@dataclass(frozen=True)
class CommittedBatch:
    """A batch the spine ran (or replayed): its checkpoint's ``metadata``, its subtasks' ``reports``, its
    :class:`~keygroups.runtime.report.BatchReport` and its ``plan`` (None for a replay)."""

    metadata: CheckpointMetadata
    reports: tuple[SubtaskReport, ...]
    report: BatchReport
    replayed: bool = False
    plan: BatchPlan | None = None
    source_reports: tuple[SourceReport, ...] = ()
    #: Spark's own time for the batch's jobs, asked of the executor when wanted (a few calls into Spark's status
    #: store: not paid by a batch whose report's ``spark_seconds`` nobody reads).
    spark_time: Callable[[], float | None] = field(default=lambda: None, repr=False, compare=False)

    @property
    def checkpoint_id(self) -> int:
        return self.metadata.checkpoint_id

    def full_report(self) -> BatchReport:
        """:attr:`report` with ``spark_seconds`` filled in."""
        return dataclasses.replace(self.report, spark_seconds=self.spark_time())


@dataclass(frozen=True)
class SourceRead:
    """A source batch's input: the next records of a replayable source (a partitioned log, Kafka; see
    ``KeyedJob.run_source_batch``), ``record_schema`` their schema (None: the source's own, e.g. Kafka's raw
    values)."""

    source: Source
    record_schema: pa.Schema | None = None
    max_records_per_subtask: int | None = None

    @property
    def staged_schema(self) -> pa.Schema:
        """The schema of what the source subtasks stage: the records' columns and their position columns."""
        return self.source.staged_schema(self.record_schema)


@runtime_checkable
class PlansAhead(Protocol):
    """An executor that can build, beside a batch, what other parallelisms' batches will need (Spark's keyed stage
    plans: a few hundred milliseconds of the driver's time at the first batch of each new parallelism). The spine
    asks it after the batch is planned (see :meth:`JobDriver.plan_ahead`)."""

    def prepare_ahead(self, ranges: Sequence[tuple[int, int, tuple[int, ...] | None]]) -> Any:
        """Build for later batches, off this batch's critical path, the plans of ``ranges`` (each
        ``(max_parallelism, parallelism, boundaries)``) over this batch's input schema."""
        ...


#: What :class:`JobDriver` calls with each batch it commits, and the batch's executor (see its ``on_commit``).
CommitListener = Callable[[CommittedBatch, BatchExecutor], None]


#: How long the retention thread of a job waits for the next commit before it ends.
_RETENTION_IDLE_SECONDS = 10.0
#: Every this many commits the retention thread also checks that every file the newest checkpoint names still exists
#: (a commit checks only its own new files): a base file in ``shared/`` removed from outside (a lifecycle rule, a
#: hand) is found within this many batches, not only at the next restart.
_COMPLETENESS_EVERY = 16


class _Retention:
    """Retention after each commit, in a thread of its own: off the batch's critical path, one at a time, and done
    before the next commit (so it never falls more than one checkpoint behind) or when asked (:meth:`wait`)."""

    def __init__(self, storage: CheckpointStorage) -> None:
        self._storage = storage
        self._queue: queue.Queue[tuple[int, dict[int, CheckpointMetadata]]] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._commits = 0
        #: What the last completeness check found missing (raised by the driver before its next commit).
        self.lost: CorruptSnapshotError | None = None

    def submit(self, checkpoint_id: int, known: Mapping[int, CheckpointMetadata]) -> None:
        """Retention after checkpoint ``checkpoint_id``; ``known``: the retained checkpoints' metadata the driver
        holds (not read again)."""
        self._queue.put((checkpoint_id, dict(known)))
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="keygroups-retention", daemon=True)
                self._thread.start()

    def _work(self) -> None:
        while True:
            try:
                checkpoint_id, known = self._queue.get(timeout=_RETENTION_IDLE_SECONDS)
            except queue.Empty:
                with self._lock:   # idle: the thread ends (a job's next commit starts another)
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            try:
                self._storage.prune(checkpoint_id, known=known)
                self._commits += 1
                if self._commits % _COMPLETENESS_EVERY == 0 and checkpoint_id in known:
                    self._storage.check_complete(known[checkpoint_id])
            except CorruptSnapshotError as e:
                self.lost = e
            except Exception as e:   # noqa: BLE001  # logged; the next prune retries what this one left
                log.warning("retention after checkpoint %s in %s failed: %s", checkpoint_id,
                            self._storage.location, e)
            finally:
                self._queue.task_done()

    def wait(self) -> None:
        """Return once every retention submitted so far is done."""
        self._queue.join()


class JobDriver:
    """The driver of one keyed job on one checkpoint location: the spine's state across batches (its fence, the
    checkpoints it committed, the restore point whose states it checked, the savepoint it started from) and
    :meth:`run`, one batch through the spine. ``fence``: claim the location at the first batch (a later driver's
    claim fences this one); ``KeyedJob`` does, the harness (which owns its location) does not.
    ``background_retention``: retention after each commit runs in a thread of its own, off the batch's critical
    path (False: inside the commit, as the test harness wants it: nothing runs after its batch returns).
    ``on_commit``: called with every batch this driver commits (not a replay) and its executor, once the batch's
    report is built: where a job records its metrics (``keygroups.metrics``); its exceptions are logged, never
    raised (the batch is committed)."""

    def __init__(self, options: JobOptions, storage: CheckpointStorage, *, fence: bool = True,
                 background_retention: bool = True, on_commit: CommitListener | None = None) -> None:
        self.options = options
        self.storage = storage
        self.on_commit = on_commit
        self._fenced = fence
        self._fence: DriverFence | None = None   # claimed at the first batch: building a job fences nobody
        self._known: Checkpoints | None = None
        #: The metadata of the retained checkpoints this driver committed or restored (retention reads no other).
        self._held: dict[int, CheckpointMetadata] = {}
        self._checked_restore_point: tuple[Any, ...] | None = None
        self._savepoint_pending = options.restore_from_savepoint is not None
        self._retention = _Retention(storage) if background_retention else None
        #: The sink's commit of a committed checkpoint that failed, retried before the next batch; and whether this
        #: driver committed the sink's output of the latest checkpoint it found when it started.
        self._sink_pending: tuple[int, list[SinkCommittable]] | None = None
        self._sink_recovered = options.sink is None
        self._ahead: tuple[int, ...] = ()

    def plan_ahead(self, parallelisms: Sequence[int]) -> None:
        """The parallelisms this job may rescale to: beside each batch, an executor that can
        (:class:`PlansAhead`: Spark's) builds the plans of those it has not built yet, for Flink's ranges, over the
        batch's input schema, off the batch's critical path (while its Spark job runs), so that the first batch at
        a new parallelism does not plan it then. Replaces what was given before; ``()`` stops it. A plan for
        other ranges (``BalancedRanges`` moving its boundaries) is still built by the batch that needs it."""
        ahead = []
        for p in parallelisms:
            check_parallelism(p, self.options.max_parallelism)
            ahead.append(int(p))
        self._ahead = tuple(dict.fromkeys(ahead))

    # ---- what the driver knows ----------------------------------------------------------------------------------

    def latest(self) -> CheckpointMetadata | None:
        """The latest complete checkpoint (what this driver committed last, else listed), None before the first."""
        return self._known.latest if self._known is not None else self.storage.latest()

    def wait_for_retention(self) -> None:
        """Return once the retention of every checkpoint committed so far is done (it runs in a thread of its
        own); CorruptSnapshotError, naming the files, if its periodic check found a file of the newest checkpoint
        gone (every ``_COMPLETENESS_EVERY`` commits): the batch that called this does not commit."""
        if self._retention is not None:
            self._retention.wait()
            lost, self._retention.lost = self._retention.lost, None
            if lost is not None:   # the newest checkpoint lost a file: list (and refuse) the location again
                self.forget()
                raise lost

    def forget(self) -> None:
        """List the storage again at the next batch instead of trusting what this driver committed last."""
        self._known = None
        self._held = {}

    # ---- one batch -------------------------------------------------------------------------------------------------

    def run(self, executor: BatchExecutor, *, parallelism: int | ParallelismPolicy, checkpoint_id: int | None = None,
            streaming: StreamingBatch | None = None, properties: Mapping[str, Any] | None = None,
            history: Sequence[BatchFigures] = (), source: SourceRead | None = None,
            processing_time: int | None = None, watermark: int | None = None) -> CommittedBatch:
        """One batch through the spine (see the module docs): ``parallelism`` an int, or a policy that picks it
        from the batch's record count and ``history``; ``checkpoint_id`` or ``streaming`` make it idempotent (a
        complete checkpoint is replayed, not run again); ``properties`` (JSON) are stored in the checkpoint;
        ``source``: the input is the next records of a source (a log, Kafka), read by source subtasks; ``processing_time`` fixes the
        batch's (epoch ms; default: now) and ``watermark`` the watermark it moves to (default: the watermark
        strategy's, from the input's largest event time): the test harness moves time itself."""
        started = time.perf_counter()
        options = self.options
        policy = _checked_parallelism(parallelism, options.max_parallelism)
        user_properties = check_user_properties(properties)
        if source is not None and policy is not None:
            raise ValueError("a source batch runs at an int parallelism (its source subtasks read by it)")
        with executor:
            key_type = executor.key_type(options.key_columns)
            source_reports: list[SourceReport] = []
            start = self._locate(checkpoint_id, streaming)
            self._recover_sink(start.checkpoints.latest, start.replay)
            if start.replay is not None:
                return self._replayed(executor, start.replay, started)
            timestamp = (options.timestamp_column if options.watermark_strategy is not None and watermark is None
                         else None)
            source_spec: SourceTaskSpec | None = None
            if source is not None:
                plan = start.plan(int(parallelism), options.assignment)   # type: ignore[arg-type]
                source_spec = plan.source_task(source.source, record_schema=source.record_schema,
                                               max_records_per_subtask=source.max_records_per_subtask)
                source_reports = executor.run_sources(source_spec)
                figures = executor.read_input(count=False, timestamp_column=timestamp)
            else:
                figures = executor.read_input(count=policy is not None, timestamp_column=timestamp)
            read = time.perf_counter()
            choice = None
            if policy is not None:
                assert figures.records is not None
                p = _checked_choice(policy, policy(figures.records, tuple(history)), figures.records,
                                    options.max_parallelism)
                choice = PolicyChoice(repr(policy), figures.records, p)
                plan = start.plan(p, options.assignment)
            elif source is None:
                plan = start.plan(int(parallelism), options.assignment)   # type: ignore[arg-type]
            if processing_time is not None:
                plan = dataclasses.replace(plan, processing_time=processing_time)
            self._check_restore_point(plan, key_type)
            if watermark is None and options.watermark_strategy is not None:
                watermark = options.watermark_strategy.next_watermark(plan.start_watermark, figures.max_event_time)
            run_id = uuid.uuid4().hex[:16]
            spec = options.keyed_task(plan, executor.input_schema, key_type, watermark, run_id)
            executor.prepare(spec, plan)
            planned = time.perf_counter()
            self._prepare_ahead(executor, plan)
            reports: list[SubtaskReport] = []
            try:
                reports = executor.run_keyed()
                idle = plan.idle_subtasks(reports)
                if idle:
                    reports += executor.run_idle(idle)
                ran = time.perf_counter()
                digest: InputDigest | None = InputDigest(0, 0)
                for r in reports:
                    digest = None if digest is None or r.input_digest is None else digest + r.input_digest
                driver_seconds = {"read": read - started, "plan": planned - read}
                self.wait_for_retention()   # the last batch's retention is done before this batch commits
                metadata = commit_batch(plan, reports, source_reports, properties=user_properties,
                                        watermark=watermark, input_digest=digest,
                                        savepoint_lineage=options.restore_from_savepoint,
                                        parallelism_policy=choice, driver_seconds=driver_seconds,
                                        prune=self._retention is None)
            except ConcurrentCommitError:   # the fenced driver's error too: nothing of the batch was published
                self.forget()   # another writer moved the location on: list it again next time
                self._abort_sink(plan, run_id, reports, published=False)
                raise
            except BaseException:
                self._abort_sink(plan, run_id, reports)
                raise
            self._committed(plan, metadata)
            if source_spec is not None:   # Kafka reports the committed positions to its consumer group
                source_spec.source.notify_checkpoint_complete(metadata)
            self._commit_sink(metadata.checkpoint_id, committables_of(reports))
            committed = time.perf_counter()
        watermark_after = plan.start_watermark if watermark is None else max(plan.start_watermark, watermark)
        report = BatchReport.of(
            checkpoint_id=metadata.checkpoint_id, job=options.name, replayed=False, parallelism=plan.parallelism,
            max_parallelism=plan.max_parallelism, reports=reports, records_late=sum(r.records_late for r in reports),
            timers=timer_summary(reports), watermark_before=plan.start_watermark, watermark_after=watermark_after,
            parallelism_reason="fixed" if choice is None else str(choice),
            state_bytes=int(key_group_state_bytes(
                metadata, plan.previous if plan.savepoint is None else None).sum()),
            assignment=None if plan.assignment is None else AssignmentDecision.from_json(   # as the report reads back
                plan.assignment.to_json(), plan.assignment.boundaries),
            driver={**driver_seconds, "commit": committed - ran}, wall_seconds=time.perf_counter() - started)
        batch = CommittedBatch(metadata, tuple(sorted(reports, key=lambda r: r.subtask)), report, False, plan,
                               tuple(sorted(source_reports, key=lambda r: r.subtask)), executor.spark_seconds)
        if self.on_commit is not None:
            try:
                self.on_commit(batch, executor)
            except Exception:   # noqa: BLE001  # the batch is committed: a listener's failure is its own
                log.exception("the commit listener of job %s failed on checkpoint %d", options.name,
                              metadata.checkpoint_id)
        return batch

    def _prepare_ahead(self, executor: BatchExecutor, plan: BatchPlan) -> None:
        """Ask the executor to build the plans of the other parallelisms of :meth:`plan_ahead` (Flink's ranges)."""
        mp = plan.max_parallelism
        ranges = [(mp, q, flink_boundaries(mp, q)) for q in self._ahead if q != plan.parallelism and q <= mp]
        if ranges and isinstance(executor, PlansAhead):
            executor.prepare_ahead(ranges)

    def _locate(self, checkpoint_id: int | None, streaming: StreamingBatch | None) -> Any:
        """Where the batch starts, as this job's driver: the first batch claims the location (fencing any earlier
        driver of it); a job started from a savepoint restores it until its first checkpoint, whose lineage then
        says so (a driver restarted with the same savepoint continues from the latest checkpoint)."""
        if self._fenced and self._fence is None:
            self._fence = DriverFence.claim(self.storage, self.options.name)
        savepoint = None
        if self._savepoint_pending:
            latest = self.latest()
            lineage = BatchProperties.of(latest).savepoint_lineage if latest is not None else None
            savepoint = None if lineage == self.options.restore_from_savepoint else self.options.restore_from_savepoint
        return locate_batch(self.storage, job_name=self.options.name, max_parallelism=self.options.max_parallelism,
                            checkpoint_id=checkpoint_id, fence=self._fence, savepoint=savepoint, streaming=streaming,
                            known=self._known)

    def _check_restore_point(self, plan: BatchPlan, key_type: KeyType) -> None:
        """Open the function's state declarations on the driver against the restore point's state metas (once per
        restore point this driver did not write itself): a changed serializer, kind or TTL raises
        StateMigrationError here, before any task runs, rather than in every task."""
        previous = plan.previous
        if previous is None or not previous.keyed_handles:
            return
        point = (previous.checkpoint_id, plan.savepoint, key_type)
        if point == self._checked_restore_point:
            return
        check_restored_states(self.options.function, previous, key_type=key_type, job_name=self.options.name,
                              max_parallelism=plan.max_parallelism, allow_pickle=self.options.allow_pickle,
                              checkpoint_id=plan.checkpoint_id)
        self._checked_restore_point = point

    def _committed(self, plan: BatchPlan, metadata: CheckpointMetadata) -> None:
        assert plan.checkpoints is not None
        self._known = plan.checkpoints.after_commit(metadata, self.storage.retain)
        held = {**self._held, metadata.checkpoint_id: metadata}
        if plan.previous is not None and plan.savepoint is None:
            held.setdefault(plan.previous.checkpoint_id, plan.previous)
        self._held = {cid: held[cid] for cid in self._known.ids if cid in held}
        self._savepoint_pending = False
        key_type = self._checked_restore_point[2] if self._checked_restore_point is not None else None
        self._checked_restore_point = (metadata.checkpoint_id, None, key_type)   # written here, by this function
        if self._retention is not None:
            self._retention.submit(metadata.checkpoint_id, self._held)

    def _replayed(self, executor: BatchExecutor, replayed: CheckpointMetadata, started: float) -> CommittedBatch:
        """A batch whose checkpoint is already complete: nothing runs; the committed figures come back, once the
        input is found to be the records it committed."""
        props = BatchProperties.of(replayed)
        committed = props.input_digest
        if committed is not None:
            given = executor.input_digest()
            if given is not None and given != committed:
                raise ReplayMismatchError(
                    f"checkpoint {replayed.checkpoint_id} is already complete (job {replayed.job_id!r}), committed "
                    f"from {committed.records} records with digest {committed.xxhash64_sum}, but this batch has "
                    f"{given.records} records with digest {given.xxhash64_sum}: a batch id may only be replayed "
                    "with the same records (as Spark replays a foreachBatch id). Nothing was processed; give new "
                    "input a new checkpoint id, or none to take the next one")
        if self.options.sink is not None:   # the batch's output again: committed if a driver died before it was
            self._commit_sink(replayed.checkpoint_id, committables_of(props.reports))
        report = dataclasses.replace(BatchReport.from_checkpoint(replayed, replayed=True),
                                     wall_seconds=time.perf_counter() - started)
        return CommittedBatch(replayed, props.reports, report, True, None, props.source_reports, executor.spark_seconds)

    # ---- the sink's two phases on the driver -----------------------------------------------------------------------

    def _recover_sink(self, latest: CheckpointMetadata | None, replay: CheckpointMetadata | None) -> None:
        """Before a batch: a sink commit that failed is retried (SinkCommitError again if it fails: no batch runs
        past uncommitted output); a driver's first batch commits the latest checkpoint's committables again (its
        driver may have died between the checkpoint's commit and the sink's; the commit is idempotent). A replayed
        batch commits its own (:meth:`_replayed`)."""
        if self._sink_pending is not None:
            checkpoint_id, committables = self._sink_pending
            self._commit_sink(checkpoint_id, committables)
        if self._sink_recovered:
            return
        if latest is not None and (replay is None or latest.checkpoint_id != replay.checkpoint_id):
            committables = committables_of(BatchProperties.of(latest).reports)
            if committables:
                log.info("job %s: committing the sink output of checkpoint %d again (the commit is idempotent: its "
                         "driver may have stopped before it)", self.options.name, latest.checkpoint_id)
                self._commit_sink(latest.checkpoint_id, committables)
        self._sink_recovered = True

    def _commit_sink(self, checkpoint_id: int, committables: list[SinkCommittable]) -> None:
        """The sink's commit of committed checkpoint ``checkpoint_id``; on failure it is kept for a retry before the
        next batch and SinkCommitError raised."""
        sink = self.options.sink
        if sink is None:
            if committables:
                log.warning("job %s: checkpoint %d holds output staged by sink %r, but the job has no sink now: that "
                            "output stays staged, not visible", self.options.name, checkpoint_id, committables[0].sink)
            return
        name = sink_name(sink)
        foreign = sorted({c.sink for c in committables if c.sink != name})
        if foreign:
            raise KeyGroupsError(
                f"checkpoint {checkpoint_id} of job {self.options.name!r} holds output staged by sink(s) {foreign}, "
                f"not yet known to be committed, but the job's sink is {name!r}, which cannot read their "
                f"committables. Run the job with the sink that staged them (Sink.name {foreign[0]!r}) for one "
                "batch, then switch sinks")
        try:
            sink.commit(checkpoint_id, committables)
        except Exception as e:
            self._sink_pending = (checkpoint_id, committables)
            raise SinkCommitError(
                f"checkpoint {checkpoint_id} of job {self.options.name!r} is committed, but its sink {name!r} failed "
                f"to publish its output ({type(e).__name__}: {e}). The output stays staged; its commit is retried "
                "before this driver's next batch and by a driver that restarts. Do not run this batch's input "
                "again: its state changes are committed", checkpoint_id) from e
        self._sink_pending = None

    def _abort_sink(self, plan: BatchPlan, run_id: str, reports: Sequence[SubtaskReport], *,
                    published: bool | None = None) -> None:
        """The sink's abort of run ``run_id`` of ``plan``, which failed; unless (``published`` None: unknown) its
        checkpoint was published all the same by this run (an error after the publish: its output is then committed
        by the next batch's recovery). Its errors are logged: the batch's own error is what the caller must see."""
        sink, checkpoint_id = self.options.sink, plan.checkpoint_id
        if sink is None:
            return
        try:
            if published is None and checkpoint_id in plan.storage.checkpoint_ids():
                stored = committables_of(BatchProperties.of(plan.storage.load(checkpoint_id)).reports)
                if any(c.run_id == run_id for c in stored):
                    self.forget()   # a new driver's recovery, in effect: the next batch commits it
                    self._sink_recovered = False
                    return
            sink.abort(checkpoint_id, run_id, committables_of(reports))
        except Exception:   # noqa: BLE001
            log.exception("job %s: the sink %s could not abort run %s of checkpoint %d", self.options.name,
                          sink_name(sink), run_id, checkpoint_id)


def _checked_parallelism(parallelism: Any, max_parallelism: int) -> ParallelismPolicy | None:
    """The policy if ``parallelism`` is one (a callable), None for a valid int; ValueError naming the value
    otherwise."""
    if callable(parallelism):
        return parallelism  # type: ignore[no-any-return]
    check_parallelism(parallelism, max_parallelism)
    return None


def _checked_choice(policy: ParallelismPolicy, chosen: Any, records: int, max_parallelism: int) -> int:
    """The policy's answer if it is a usable parallelism; a ValueError naming the policy and the bounds otherwise."""
    if isinstance(chosen, bool) or not isinstance(chosen, int) or not 1 <= chosen <= max_parallelism:
        raise ValueError(f"parallelism policy {policy!r} chose {chosen!r} for a batch of {records} records; a "
                         f"parallelism is an int in [1, {max_parallelism}] (the job's max parallelism)")
    return chosen


__all__ = ["BatchExecutor", "CommitListener", "CommittedBatch", "InputFigures", "JobDriver", "JobOptions",
           "PlansAhead", "SourceRead", "pickle_function"]
