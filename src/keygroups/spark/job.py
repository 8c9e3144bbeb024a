"""The stateful job runner: one micro-batch on Spark is one checkpoint, and every run may use another parallelism.

This module is the Spark half of a job only: :class:`KeyedJob` checks its arguments, and each batch goes through the
batch spine (:mod:`keygroups.runtime.batch`: plan, run the subtasks, commit, report) on a
:class:`~keygroups.spark.executor.SparkExecutor`, the spine the test harness runs on its local executor.

Data flow of :meth:`KeyedJob.run_batch` (see DESIGN.md):

1. driver: the input is placed so that each Spark partition holds exactly one subtask's key groups;
2. task *i*: restores only its key groups from the latest complete checkpoint, runs the function over its records
   (Arrow batches, grouped by key, in order), writes its output and its state snapshot under ``chk-<n>/`` with fresh
   unique names, and returns a small report;
3. driver: once every subtask has reported, commits ``chk-<n>/_metadata`` atomically. Until then the checkpoint does
   not exist, so a failed or half-run batch leaves the previous checkpoint as it was and can simply be run again.

A task that Spark retries writes new files; only the successful attempt's report reaches the driver, so its files
are the ones the checkpoint references and a batch's updates are never applied twice. The output DataFrame reads
the files the committed subtasks wrote (built when first read), so evaluating it again re-reads, never re-processes.
"""

from __future__ import annotations

import difflib
import inspect
import logging
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any, Literal

import pyarrow as pa
from pyspark import cloudpickle
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import StructType, _parse_datatype_string

from keygroups._ranges import check_max_parallelism, check_parallelism
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.errors import CheckpointNotFoundError, KeyGroupsError
from keygroups.runtime.assignment import Assignment, resolve_assignment
from keygroups.runtime.batch import CommittedBatch, JobDriver, JobOptions, SourceRead, pickle_function
from keygroups.runtime.driver import StreamingBatch, check_key_columns, check_output_schema
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.runtime.report import BatchReport, SourceReport, SubtaskReport, format_time
from keygroups.runtime.scaling import HISTORY, BatchFigures, ParallelismPolicy
from keygroups.runtime.sink import Sink, check_checkpoint_output, check_sink
from keygroups.runtime.source import Source, as_source
from keygroups.runtime.spec import check_warm_heap_backends, check_write_back_batches
from keygroups.runtime.watermarks import WatermarkStrategy, check_late_records
from keygroups.serializers.schema_formats import parse_ddl, to_arrow
from keygroups.spark.executor import SparkExecutor, SparkPlanCache, read_checkpoint_files
from keygroups.spark.metrics import spark_batch_listener
from keygroups.state.timers import NO_WATERMARK

#: Every batch's INFO line and late-data WARNING.
LOG = logging.getLogger("keygroups")

#: The keyed state backends a job runs on.
Backend = Literal["heap", "rocksdb"]
_BACKENDS = ("heap", "rocksdb")
#: What happens to records at or before the watermark.
LateRecords = Literal["drop", "output"]


def _arrow_schema(schema: Any) -> pa.Schema:
    """A pyarrow schema from a pyarrow Schema, a Spark StructType or a DDL string."""
    if isinstance(schema, pa.Schema):
        return schema
    if isinstance(schema, str):
        schema = _parse_datatype_string(schema)
    if not isinstance(schema, StructType):
        raise TypeError(f"output_schema must be a pyarrow Schema, a Spark StructType or a DDL string, got {schema!r}")
    return to_arrow_schema(schema, timezone="UTC")   # output timestamps are instants, written as UTC


class BatchResult:
    """What one micro-batch did: its committed checkpoint (``metadata``), its output (``output``, a DataFrame over
    the files its subtasks wrote, built when first read), its figures (``report``, a
    :class:`~keygroups.runtime.report.BatchReport`) and its subtasks' reports (``reports``; a source batch's source
    subtasks' in ``source_reports``)."""

    def __init__(self, batch: CommittedBatch, spark: SparkSession, storage: CheckpointStorage,
                 output_schema: pa.Schema, late_schema: pa.Schema | None) -> None:
        self._batch = batch
        self._spark = spark
        self._storage = storage
        self._output_schema = output_schema
        self._late_schema = late_schema
        self.metadata: CheckpointMetadata = batch.metadata
        self.reports: list[SubtaskReport] = list(batch.reports)
        #: A source batch's source subtasks' reports (what each read, and where each split goes on); () otherwise.
        self.source_reports: tuple[SourceReport, ...] = batch.source_reports
        self.replayed: bool = batch.replayed

    @cached_property
    def report(self) -> BatchReport:
        """The batch in figures: records in, late and out, the watermark, restore modes, bytes, timers, the
        ranges, phase times and Spark's own time for the batch's jobs."""
        return self._batch.full_report()

    @cached_property
    def output(self) -> DataFrame:
        """The batch's output: a lazy DataFrame over the files the committed subtasks wrote (evaluating it again
        reads them again; a replay's is the committed one). An output of at most
        :data:`~keygroups.spark.executor.ONE_PARTITION_RECORDS` records is one partition (a sink's aggregate over it
        is one Spark job); a larger one has a partition per file. A job whose output goes only to its sink
        (``checkpoint_output=False``, the default with a sink) has none here: KeyGroupsError."""
        if self.metadata.outputs == [] and any(r.output_file is None for r in self.reports):
            raise KeyGroupsError(f"checkpoint {self.checkpoint_id}'s output went to the job's sink only, not into the "
                                 "checkpoint: read it where the sink wrote it, or build the job with "
                                 "checkpoint_output=True to keep it in the checkpoint too")
        return read_checkpoint_files(self._spark, self._storage, self.metadata.outputs, self._output_schema,
                                     records=sum(r.records_out for r in self.reports))

    @cached_property
    def late_output(self) -> DataFrame | None:
        """The records that arrived behind the watermark, with ``late_records="output"`` (None otherwise)."""
        if self._late_schema is None:
            return None
        return read_checkpoint_files(self._spark, self._storage, self.metadata.late_outputs, self._late_schema,
                                     records=sum(r.records_late for r in self.reports))

    @property
    def checkpoint_id(self) -> int:
        return self.metadata.checkpoint_id

    @property
    def parallelism(self) -> int:
        return self.metadata.parallelism

    @property
    def seconds(self) -> float:
        """The batch's wall time on the driver."""
        return self._batch.report.wall_seconds

    @property
    def watermark(self) -> int:
        """The batch's watermark (epoch ms; ``NO_WATERMARK`` before any event time), where the next batch starts."""
        after = self._batch.report.watermark_after
        return NO_WATERMARK if after is None else after

    @property
    def records_late(self) -> int:
        """Records at or before the watermark the batch started with: dropped, or in ``late_output``."""
        return self._batch.report.records_late

    @property
    def records_in(self) -> int:
        return self._batch.report.records_in

    @property
    def restored_bytes(self) -> list[int]:
        """Per subtask, bytes of checkpoint files it read to restore its state."""
        return [r.restored.bytes_read for r in self.reports]

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of keyed and operator state this checkpoint wrote."""
        keyed = sum(h.size for h in self.metadata.keyed_handles)
        return keyed + sum(h.size for h in self.metadata.operator_handles)

    def __repr__(self) -> str:
        return f"BatchResult({self._batch.report})"


class KeyedJob:
    """A keyed, stateful job whose state lives in checkpoints and whose parallelism may change between batches.

    ``function`` is a :class:`~keygroups.runtime.KeyedProcessFunction`; ``key_columns`` name the input columns
    that form the key (several form a Flink tuple); ``output_schema`` is the schema of what the function returns (a
    pyarrow Schema, a Spark StructType or a DDL string); ``max_parallelism`` is the number of key groups (a later
    run may multiply or divide it by an integer, which splits or merges key groups at restore; any other change is
    refused); ``checkpoint_location`` is a local path or an fsspec URL, and ``storage_options`` go to its
    fsspec filesystem (endpoint, credentials) in the driver and in every task, and for reading the output back where
    Spark's own reader cannot reach the location (see :func:`read_checkpoint_files`). ``order_by`` names columns that
    order a key's records inside a batch (Spark's shuffle keeps no order, so give one whenever order matters to the
    function); ``timestamp_column`` names the event-time column (a timestamp, or a long of epoch ms), given to the
    function as ``context.timestamp`` in epoch ms; with a ``watermark_strategy`` (e.g.
    ``WatermarkStrategy.for_bounded_out_of_orderness(timedelta(minutes=5))``) the job keeps a watermark: each batch
    first finds its largest event time, records at or before the watermark the batch started with are late
    (``late_records="drop"`` counts and drops them, ``"output"`` keeps them in ``BatchResult.late_output``), and
    event-time timers up to the batch's new watermark fire after its records; ``retain`` is how many
    complete checkpoints to keep. ``local_dir`` names the executors' local directory where warm state stays between
    batches (RocksDB keeps its database there; default: the system temporary directory). ``warm_heap_backends`` is
    how many heap backends (each one subtask's state, in memory) a Python worker process keeps between batches so
    that the next batch resumes them instead of restoring (0: none; Spark must reuse its Python workers, as it does
    by default). ``write_back_batches``: with ``backend="rocksdb"``, each subtask's database kept on local disk is
    written at most every this many batches; the batches in between keep their changes in the decoded values the
    worker process holds beside it and write only their checkpoint (fewer writes and RocksDB compactions per batch;
    after a lost worker, the next batch reads up to this many checkpoints' changes to catch the database up); 1
    writes it at every batch; None: the backend's default, 4. ``forward_to_warm_process`` (heap): Spark runs a task
    on whichever Python worker of the host is idle, while a heap backend stays in the worker that ran its subtask;
    with True (the default) a task whose state another worker of its host holds warm sends its input there and that
    worker runs the subtask (:mod:`keygroups.runtime.warm_exchange`: a Unix socket private to this user), so a
    subtask resumes warm whichever worker Spark picked (a forwarded subtask's function sees no Spark ``TaskContext``
    of its own); False runs every task where Spark placed it. ``restore_from_savepoint`` names a savepoint in
    ``checkpoint_location`` (see :meth:`savepoint`) that the job's first batch restores instead of the latest
    checkpoint, at any parallelism; the checkpoints after it say so, and a driver restarted with the same argument
    continues from the latest of them (Flink's ``-s``, no-claim mode). ``late_warning_share`` is the share of a
    batch's records that may be late before the batch logs a WARNING on the ``keygroups`` logger (every batch logs
    one INFO line, its :class:`BatchReport`).

    Mistakes are refused on the driver before any Spark job starts, each naming the argument, the value and what is
    allowed: here the arguments themselves (``backend``, column-name arguments, ``output_schema`` against an
    ``output_schema`` attribute the function may declare); at each batch the input's columns and types (key,
    ``order_by``, ``timestamp_column``), and at the first batch of a restore point the function's state
    declarations against the restored ones (kind, TTL, serializers: ``StateMigrationError``; its ``open`` runs on
    the driver against an empty backend) and the max parallelism. Input columns may have any name: names with a
    dot or a backtick, or like keygroups' own internal columns, work as any other. Building a job needs no Spark
    session.
    ``assignment`` chooses each batch's key-group ranges: ``"flink"`` (the default: Flink's equal
    ranges, Flink's ownership exactly), ``"balanced"`` (contiguous ranges cut by each key group's measured records
    and state bytes, moved only when it pays; see :mod:`keygroups.runtime.assignment`) or an assignment object
    such as ``BalancedRanges(state_weight=0.5)``.

    ``sink`` (a :class:`~keygroups.sinks.Sink`, e.g. ``ParquetSink(path)``) takes the output inside the keyed stage:
    each task writes its output to the sink's staging area and pre-commits it with the checkpoint, and the driver
    makes it visible once the checkpoint is committed, exactly once (Flink's two-phase-commit sinks; see
    :mod:`keygroups.runtime.sink`): no second Spark job reads the output back. ``checkpoint_output`` says whether the
    output is also written into the checkpoint, for ``BatchResult.output`` (default: only without a sink).
    """

    def __init__(
        self,
        name: str,
        key_columns: Sequence[str] | str,
        function: KeyedProcessFunction,
        *,
        output_schema: Any,
        max_parallelism: int,
        checkpoint_location: str,
        backend: Backend = "heap",
        order_by: Sequence[str] | str = (),
        timestamp_column: str | None = None,
        retain: int = 3,
        storage_options: dict[str, Any] | None = None,
        allow_pickle: bool = False,
        local_dir: str | None = None,
        warm_heap_backends: int = 4,
        restore_from_savepoint: str | None = None,
        watermark_strategy: WatermarkStrategy | None = None,
        late_records: LateRecords = "drop",
        late_warning_share: float = 0.1,
        assignment: str | Assignment = "flink",
        sink: Sink | None = None,
        checkpoint_output: bool | None = None,
        write_back_batches: int | None = None,
        forward_to_warm_process: bool = True,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string (the job's name in its checkpoints), got {name!r}")
        self.name = name
        self.key_columns = check_key_columns(_column_names("key_columns", key_columns))
        self.max_parallelism = check_max_parallelism(max_parallelism)
        # A DDL string needs a Spark session to parse: without one it is parsed at the first batch, so that a job
        # can be built before the session exists.
        self._output_schema: pa.Schema | None = None
        self._output_ddl: str | None = None
        if isinstance(output_schema, str) and SparkSession.getActiveSession() is None:
            _check_ddl_without_spark(output_schema)
            self._output_ddl = output_schema
        else:
            self._output_schema = check_output_schema(_arrow_schema(output_schema))
        self._function = pickle_function(function, cloudpickle.dumps)  # as Spark ships functions: __main__ too
        self._declared_output = getattr(function, "output_schema", None)
        if self._output_schema is not None:
            _check_declared_output(self._declared_output, self._output_schema)
        if backend not in _BACKENDS:
            close = difflib.get_close_matches(str(backend), _BACKENDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"backend {backend!r} is not a state backend{hint}; allowed: 'heap' (state in memory) "
                             "or 'rocksdb' (state in a local RocksDB database)")
        self.backend = backend
        self.order_by = _column_names("order_by", order_by)
        if timestamp_column is not None and (not isinstance(timestamp_column, str) or not timestamp_column):
            raise TypeError(f"timestamp_column must be a column name (a non-empty str) or None, got "
                            f"{timestamp_column!r}")
        self.timestamp_column = timestamp_column
        if watermark_strategy is not None and not isinstance(watermark_strategy, WatermarkStrategy):
            raise TypeError(f"watermark_strategy must be a keygroups.runtime.WatermarkStrategy, got "
                            f"{watermark_strategy!r}")
        if watermark_strategy is not None and timestamp_column is None:
            raise ValueError("a watermark_strategy needs the event-time column: give timestamp_column too")
        self.watermark_strategy = watermark_strategy
        self.late_records = check_late_records(late_records)
        if (isinstance(late_warning_share, bool) or not isinstance(late_warning_share, (int, float))
                or not 0 <= late_warning_share <= 1):
            raise ValueError(f"late_warning_share must be a number in [0, 1] (the share of a batch's records that "
                             f"may be late before a WARNING is logged), got {late_warning_share!r}")
        self.late_warning_share = float(late_warning_share)
        self.allow_pickle = allow_pickle
        self.local_dir = local_dir
        self.warm_heap_backends = check_warm_heap_backends(warm_heap_backends)
        self.write_back_batches = check_write_back_batches(write_back_batches, backend)
        if not isinstance(forward_to_warm_process, bool):
            raise TypeError(f"forward_to_warm_process must be a bool (whether a heap subtask runs in the Python "
                            f"worker of its host that holds its state warm), got {forward_to_warm_process!r}")
        self.forward_to_warm_process = forward_to_warm_process
        self.storage = CheckpointStorage(checkpoint_location, retain=retain, storage_options=storage_options)
        self.restore_from_savepoint = restore_from_savepoint
        self.assignment = resolve_assignment(assignment)
        self.sink = check_sink(sink)
        self.checkpoint_output = check_checkpoint_output(checkpoint_output, self.sink)
        #: Read each batch's input once (persisted while its count and largest event time are found). False runs
        #: the former path, a Spark job per figure, for the comparison in benchmarks/bench_runner.py only.
        self._read_input_once = True
        self._driver: JobDriver | None = None
        self._plans = SparkPlanCache()
        self._ahead: tuple[int, ...] = ()

    @property
    def output_schema(self) -> pa.Schema:
        """The schema of the function's output records (a DDL string given without a Spark session is parsed here,
        at the first batch)."""
        if self._output_schema is None:
            assert self._output_ddl is not None
            self._output_schema = check_output_schema(_arrow_schema(self._output_ddl))
            _check_declared_output(self._declared_output, self._output_schema)
        return self._output_schema

    @property
    def driver(self) -> JobDriver:
        """The job's driver (:class:`~keygroups.runtime.batch.JobDriver`), made at the first batch."""
        if self._driver is None:
            options = JobOptions(
                name=self.name, key_columns=self.key_columns, function=self._function,
                output_schema=self.output_schema, max_parallelism=self.max_parallelism, backend=self.backend,
                order_by=self.order_by, timestamp_column=self.timestamp_column,
                watermark_strategy=self.watermark_strategy, late_records=self.late_records,
                allow_pickle=self.allow_pickle, local_dir=self.local_dir, warm_heap_backends=self.warm_heap_backends,
                assignment=self.assignment, restore_from_savepoint=self.restore_from_savepoint, sink=self.sink,
                checkpoint_output=self.checkpoint_output, write_back_batches=self.write_back_batches)
            self._driver = JobDriver(options, self.storage, on_commit=spark_batch_listener(self))   # metrics
            self._driver.plan_ahead(self._ahead)
        return self._driver

    def plan_ahead(self, *parallelisms: int) -> None:
        """Say which parallelisms this job may rescale to (a query that switches between 2 and 4 subtasks:
        ``job.plan_ahead(2, 4)``): each batch builds the Spark plans of those it has not built yet in a thread of
        its own while its Spark job runs, so the first batch at a new parallelism does not pay for planning it
        (a few hundred milliseconds of the driver's time on a small batch; built once per input schema, kept
        while it stays the same). Without it, a parallelism's plans are built by its first batch. Each call
        replaces the set; ValueError for a parallelism outside ``[1, max_parallelism]``."""
        for p in parallelisms:
            check_parallelism(p, self.max_parallelism)
        self._ahead = tuple(int(p) for p in parallelisms)
        if self._driver is not None:
            self._driver.plan_ahead(self._ahead)

    def latest_checkpoint(self) -> CheckpointMetadata | None:
        """The latest complete checkpoint, None before the first batch."""
        if self._driver is not None:
            self._driver.wait_for_retention()
        return self.storage.latest()

    def wait_for_retention(self) -> None:
        """Return once retention after every batch so far is done (it runs beside the next batch, off its critical
        path): older checkpoints beyond ``retain`` and files no retained checkpoint references are gone."""
        if self._driver is not None:
            self._driver.wait_for_retention()

    def savepoint(self, name: str) -> str:
        """Take a savepoint of the latest complete checkpoint, between batches: a self-contained full snapshot in
        ``savepoints/<name>/`` that retention never deletes and either backend restores (start a job from it with
        ``restore_from_savepoint=name``). Returns its directory."""
        latest = self.latest_checkpoint()
        if latest is None:
            raise CheckpointNotFoundError(f"job {self.name!r} has no complete checkpoint in "
                                          f"{self.storage.location} yet: run a batch before taking a savepoint")
        return self.storage.savepoint(latest, name)

    # ---- one micro-batch ----------------------------------------------------------------------------------------

    def run_batch(self, df: DataFrame, *, parallelism: int | ParallelismPolicy, checkpoint_id: int | None = None,
                  properties: dict[str, Any] | None = None) -> BatchResult:
        """Process the micro-batch ``df`` and commit it as one checkpoint; the output is ``run_batch(...).output``,
        its figures ``run_batch(...).report``. ``parallelism`` is an int, or a policy that picks it from the batch's
        record count (see :meth:`foreach_batch`). ``properties`` (JSON) are stored in the checkpoint's metadata.

        The input is read once: where the batch needs its record count (a policy) or its largest event time (a
        watermark) before placing the records, ``df`` is persisted while one Spark job counts it and finds the
        maximum, the keyed stage reads the persisted rows, and they are released when the batch ends.

        With an explicit ``checkpoint_id`` (e.g. Spark's streaming batch id) the call is idempotent: a checkpoint
        that is already complete is not processed again; its committed output comes back instead, once ``df`` is
        found to hold the records that checkpoint committed (ReplayMismatchError otherwise: another input under a
        completed id must not be silently dropped)."""
        return self._run(df, parallelism, checkpoint_id=checkpoint_id, properties=properties)

    def _run(self, df: DataFrame, parallelism: int | ParallelismPolicy, *, checkpoint_id: int | None = None,
             properties: dict[str, Any] | None = None, history: Sequence[BatchFigures] = (),
             streaming: StreamingBatch | None = None) -> BatchResult:
        driver = self.driver
        executor = SparkExecutor(df.sparkSession, driver.options, self.storage, self._plans, df,
                                 read_once=self._read_input_once, forward=self.forward_to_warm_process)
        batch = driver.run(executor, parallelism=parallelism, checkpoint_id=checkpoint_id, streaming=streaming,
                           properties=properties, history=history)
        return self._result(df.sparkSession, batch, executor)

    def run_source_batch(self, spark: SparkSession, source: Source | str, *, parallelism: int,
                         record_schema: pa.Schema | None = None,
                         max_records_per_subtask: int | None = None) -> BatchResult:
        """One micro-batch whose input is the next records of a replayable source: a partitioned-log directory
        (:mod:`keygroups.sources`) or a :class:`~keygroups.sources.KafkaSource`.

        There is no input DataFrame to take the session from, so the session comes first, as in
        ``spark.read...``; the rest is keyword-only, as in :meth:`run_batch`. ``record_schema`` is the records'
        schema (a pyarrow Schema; a Kafka source of raw values without a decoder needs none).

        Source subtask *i* (a Spark task) restores its share of the source's positions (``(partition, offset)``
        of a log, ``(topic, partition, offset)`` of Kafka) from the previous checkpoint's operator state — split
        evenly over this batch's subtasks, whatever the previous parallelism — reads up to
        ``max_records_per_subtask`` records and stages them under ``chk-<n>/``; the keyed stage then runs as in
        :meth:`run_batch`, and the checkpoint commits the new positions with the keyed state. A resumed job, at any
        parallelism, continues exactly where the last complete checkpoint left off. The batch runs through the
        same spine as :meth:`run_batch` (:class:`~keygroups.runtime.batch.JobDriver`); its report's
        ``source_reports`` are typed (:class:`~keygroups.runtime.report.SourceReport`)."""
        driver = self.driver
        read = SourceRead(as_source(source), record_schema, max_records_per_subtask)
        executor = SparkExecutor(spark, driver.options, self.storage, self._plans, staged=read.staged_schema,
                                 read_once=self._read_input_once, forward=self.forward_to_warm_process)
        batch = driver.run(executor, parallelism=parallelism, source=read)
        return self._result(spark, batch, executor)

    def _result(self, spark: SparkSession, batch: CommittedBatch, executor: SparkExecutor) -> BatchResult:
        """The committed batch: its output DataFrame reads the files the committed subtasks wrote (its late output
        those of the late records, in the input's schema), when first read."""
        late_schema = None
        if self.late_records == "output":
            late_schema = executor.input_schema
        result = BatchResult(batch, spark, self.storage, self.output_schema, late_schema)
        self._log(result)
        return result

    def _log(self, result: BatchResult) -> None:
        """One INFO line per batch; a WARNING when more than ``late_warning_share`` of its records were late."""
        if LOG.isEnabledFor(logging.INFO):
            LOG.info("job %s: %s", self.name, result.report)
        report = result._batch.report   # Spark's job time not needed below
        if report.records_late and report.records_late > self.late_warning_share * report.records_in:
            went = "dropped" if self.late_records == "drop" else "sent to the late output"
            LOG.warning(
                "job %s: checkpoint %d %s %d of %d records (%.0f%%) as late: their event times were at or before "
                "the watermark %s the batch started with; the batch's event times ran from %s to %s. A file "
                "source may take files out of order (see the guide), or the watermark strategy's "
                "out-of-orderness bound is too small for this input",
                self.name, report.checkpoint_id, went, report.records_late, report.records_in,
                100 * report.late_share, format_time(report.watermark_before), format_time(report.event_time_min),
                format_time(report.event_time_max))

    def foreach_batch(self, sink: Callable[..., None] | None = None, *,
                      parallelism: int | ParallelismPolicy) -> Callable[[DataFrame, int], None]:
        """A function for ``stream.writeStream.foreachBatch(...)``: each micro-batch runs through this job as one
        checkpoint whose id follows from Spark's batch id, so a batch Spark replays is not applied twice; ``sink``
        then gets the batch's committed output (the same output again on a replay, for idempotent sinks).

        On a location without checkpoints the checkpoint id is Spark's batch id. A query that starts on a location
        that has some (a new query, e.g. with a new Spark checkpoint), or that continues a savepoint
        (``restore_from_savepoint``: one written by ``keygroups flink import`` or ``write_savepoint`` included),
        numbers its checkpoints on from the newest, whatever its first batch id; each checkpoint records its query
        and batch, so a restarted query finds where it was (see :class:`~keygroups.runtime.driver.StreamingBatch`).
        Over Spark Connect, where a ``foreachBatch`` function is not told its query's id, a batch continues the
        latest checkpoint's query when it is that checkpoint's batch again (a replay) or the next one.

        ``sink`` is called as Spark calls a foreachBatch function, ``sink(output, batch_id)``; a sink that takes a
        third positional parameter gets the batch's :class:`BatchResult` too, ``sink(output, batch_id, result)``
        (``result.report`` holds the batch's figures: records late, the watermark, restore modes, phase times).
        Every batch is also logged on the ``keygroups`` logger (one INFO line; a WARNING when more than
        ``late_warning_share`` of its records were late). Spark's own progress (``query.lastProgress``) counts
        each input record once (``numInputRows``: the batch is read once); it cannot carry keygroups' figures, as
        ``StreamingQueryProgress.observedMetrics`` holds only metrics observed on the streaming plan itself, and
        everything a foreachBatch function runs is a separate query: feed dashboards from the sink's ``result``
        or the log lines instead.

        ``parallelism`` is an int (every batch), or a policy that picks each batch's parallelism (see
        :mod:`keygroups.runtime.scaling`: ``RecordsPerSubtask``, ``TargetBatchDuration``, or any callable
        ``(records, history) -> int``): the query rescales between micro-batches without a restart. The chosen
        parallelism is the batch's ``BatchResult.parallelism`` and is stored in its checkpoint, with the policy's
        reasons (``result.report.parallelism_reason``)."""
        _checked_parallelism(parallelism, self.max_parallelism)
        if sink is not None and not self.checkpoint_output:
            raise ValueError("foreach_batch(sink) hands the sink each batch's output read back from the checkpoint, "
                             "but this job writes its output only to its in-task sink (KeyedJob(sink=...)); build "
                             "the job with checkpoint_output=True, or call foreach_batch without a sink")
        wants_result = sink is not None and _takes_three_arguments(sink)
        history: list[BatchFigures] = []

        def run(df: DataFrame, batch_id: int) -> None:
            result = self._run(df, parallelism, history=tuple(history[-HISTORY:]),
                               streaming=StreamingBatch(int(batch_id), _streaming_query_id(df)))
            if not result.replayed:
                decision = result._batch.report.assignment
                history.append(BatchFigures(result.checkpoint_id, result.parallelism, result.records_in,
                                            result.seconds, decision.max_over_mean if decision else None))
            if sink is not None:
                if wants_result:
                    sink(result.output, int(batch_id), result)
                else:
                    sink(result.output, int(batch_id))

        return run


def _column_names(argument: str, names: Any) -> tuple[str, ...]:
    """``names`` (one column name, or a sequence of them) as a tuple; TypeError naming the argument otherwise."""
    if isinstance(names, str):
        names = (names,)
    try:
        out = tuple(names)
    except TypeError:
        raise TypeError(f"{argument} must be a column name or a list of column names, got {names!r}") from None
    bad = [n for n in out if not isinstance(n, str) or not n]
    if bad:
        raise TypeError(f"{argument} must be a column name or a list of column names (non-empty strings), got "
                        f"{names!r}")
    return out


def _check_ddl_without_spark(ddl: str) -> None:
    """Refuse now what Spark's DDL parser will give at the first batch but a job cannot output (no fields, one name
    twice), read with keygroups' own DDL parser; anything that parser cannot read is left to Spark's."""
    try:
        schema = pa.schema(list(to_arrow(parse_ddl(ddl)))) if ddl.strip() else pa.schema([])
    except ValueError as e:
        if "more than once" in str(e):
            raise ValueError(f"output_schema {ddl!r}: {e}; each output field needs its own name") from None
        return   # Spark's parser decides at the first batch, and says why
    check_output_schema(schema)


def _check_declared_output(declared: Any, schema: pa.Schema) -> None:
    """ValueError when the function declares an ``output_schema`` that differs from the job's ``output_schema``."""
    if declared is None:
        return
    theirs = _arrow_schema(declared)
    if theirs.names != schema.names or theirs.types != schema.types:
        ours = ", ".join(f"{f.name}: {f.type}" for f in schema)
        declared_text = ", ".join(f"{f.name}: {f.type}" for f in theirs)
        raise ValueError(f"output_schema ({ours}) differs from the output_schema the function declares "
                         f"({declared_text}); give the job the schema the function declares")


def _checked_parallelism(parallelism: Any, max_parallelism: int) -> ParallelismPolicy | None:
    """The policy if ``parallelism`` is one (a callable), None for a valid int; ValueError naming the value
    otherwise."""
    from keygroups.runtime.batch import _checked_parallelism as checked

    return checked(parallelism, max_parallelism)


def _takes_three_arguments(sink: Callable[..., Any]) -> bool:
    """Whether ``sink`` accepts ``(output, batch_id, result)``: three positional parameters, or ``*args``."""
    try:
        parameters = list(inspect.signature(sink).parameters.values())
    except (TypeError, ValueError):   # a builtin without a signature: call it as Spark would
        return False
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in parameters):
        return True
    positional = [p for p in parameters if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                      inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3


def _streaming_query_id(df: DataFrame) -> str | None:
    """The id of the streaming query whose micro-batch ``df`` is: Spark sets it as a local property of the thread
    that calls a ``foreachBatch`` function. None where there is no SparkContext to ask (Spark Connect)."""
    try:
        query = df.sparkSession.sparkContext.getLocalProperty("sql.streaming.queryId")
    except Exception:   # noqa: BLE001  # Spark Connect: no SparkContext
        return None
    return query or None


__all__ = ["BatchResult", "KeyedJob", "read_checkpoint_files"]
