"""The stateful job runner: one micro-batch on Spark is one checkpoint, and every run may use another parallelism.

This module is the Spark half only: the batch protocol (checkpoint ids, the max-parallelism check, task specs, idle
subtasks, the commit) is :mod:`keygroups.runtime.driver`'s; here are placement, the tasks, and reading the output.

Data flow of :meth:`KeyedJob.run_batch` (see DESIGN.md):

1. driver: the input is placed so that Spark partition *i* holds exactly subtask *i*'s key groups;
2. task *i*: restores only its key groups from the latest complete checkpoint, runs the function over its records
   (Arrow batches, grouped by key, in order), writes its output and its state snapshot under ``chk-<n>/`` with fresh
   unique names, and returns a small report;
3. driver: once every subtask has reported, commits ``chk-<n>/_metadata`` atomically. Until then the checkpoint does
   not exist, so a failed or half-run batch leaves the previous checkpoint as it was and can simply be run again.

A task that Spark retries writes new files; only the successful attempt's report reaches the driver, so its files
are the ones the checkpoint references and a batch's updates are never applied twice. The output DataFrame reads
the files the committed subtasks wrote, so evaluating it again re-reads, never re-processes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
from pyspark import TaskContext, cloudpickle
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
from pyspark.sql.types import StructType, _parse_datatype_string

from keygroups._ranges import check_max_parallelism, check_parallelism
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.runtime.driver import BatchPlan, begin_batch, commit_batch
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.runtime.source import run_source_subtask, staged_schema
from keygroups.runtime.subtask import KeyedTaskSpec, check_warm_heap_backends, run_keyed_subtask
from keygroups.spark.partitioner import partition_by_key_group

_REPORT_SCHEMA = "subtask int, report string"
_REPORT_ARROW = pa.schema([("subtask", pa.int32()), ("report", pa.string())])


def _input_arrow_schema(df: DataFrame) -> pa.Schema:
    """The Arrow schema ``mapInArrow`` hands a DataFrame's rows over in: Spark timestamps carry the session's time
    zone, as Spark sends them."""
    return to_arrow_schema(df.schema, timezone=df.sparkSession.conf.get("spark.sql.session.timeZone"))


def _arrow_schema(schema: Any) -> pa.Schema:
    """A pyarrow schema from a pyarrow Schema, a Spark StructType or a DDL string."""
    if isinstance(schema, pa.Schema):
        return schema
    if isinstance(schema, str):
        schema = _parse_datatype_string(schema)
    if not isinstance(schema, StructType):
        raise TypeError(f"output_schema must be a pyarrow Schema, a Spark StructType or a DDL string, got {schema!r}")
    return to_arrow_schema(schema, timezone="UTC")   # output timestamps are instants, written as UTC


def _pickle_function(function: KeyedProcessFunction) -> bytes:
    if not isinstance(function, KeyedProcessFunction):
        raise TypeError(f"function must be a KeyedProcessFunction instance, got {type(function).__name__}")
    return cloudpickle.dumps(function)  # as Spark ships functions: classes defined in __main__ travel too


@dataclass
class BatchResult:
    """What one micro-batch did: its committed checkpoint, its output, and per-subtask figures."""

    checkpoint_id: int
    parallelism: int
    output: DataFrame
    metadata: CheckpointMetadata
    reports: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    replayed: bool = False

    @property
    def records_in(self) -> int:
        return sum(r.get("records_in", 0) for r in self.reports)

    @property
    def restored_bytes(self) -> list[int]:
        return [r["restored"]["bytes_read"] for r in self.reports]

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes of keyed and operator state this checkpoint wrote."""
        keyed = sum(h.size for h in self.metadata.keyed_handles)
        return keyed + sum(h.size for h in self.metadata.operator_handles)


class KeyedJob:
    """A keyed, stateful job whose state lives in checkpoints and whose parallelism may change between batches.

    ``function`` is a :class:`~keygroups.runtime.KeyedProcessFunction`; ``key_columns`` name the input columns
    that form the key (several form a Flink tuple); ``output_schema`` is the schema of what the function returns (a
    pyarrow Schema, a Spark StructType or a DDL string); ``max_parallelism`` is the number of key groups, fixed for
    the life of the state; ``checkpoint_location`` is a local path or an fsspec URL. ``order_by`` names columns that
    order a key's records inside a batch (Spark's shuffle keeps no order, so give one whenever order matters to the
    function); ``timestamp_column`` gives each record's event time to ``context.timestamp``; ``retain`` is how many
    complete checkpoints to keep. ``local_dir`` names the executors' local directory where warm state stays between
    batches (RocksDB keeps its database there; default: the system temporary directory). ``warm_heap_backends`` is
    how many heap backends (each one subtask's state, in memory) a Python worker process keeps between batches so
    that the next batch resumes them instead of restoring (0: none; Spark must reuse its Python workers, as it does
    by default).
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
        backend: str = "heap",
        order_by: Sequence[str] = (),
        timestamp_column: str | None = None,
        retain: int = 3,
        storage_options: dict[str, Any] | None = None,
        allow_pickle: bool = False,
        local_dir: str | None = None,
        warm_heap_backends: int = 4,
    ) -> None:
        if not name:
            raise ValueError("a job needs a non-empty name")
        self.name = name
        self.key_columns = (key_columns,) if isinstance(key_columns, str) else tuple(key_columns)
        if not self.key_columns:
            raise ValueError("a keyed job needs at least one key column")
        self.max_parallelism = check_max_parallelism(max_parallelism)
        self.output_schema = _arrow_schema(output_schema)
        self._function = _pickle_function(function)
        self.backend = backend
        self.order_by = tuple(order_by)
        self.timestamp_column = timestamp_column
        self.allow_pickle = allow_pickle
        self.local_dir = local_dir
        self.warm_heap_backends = check_warm_heap_backends(warm_heap_backends)
        self.storage = CheckpointStorage(checkpoint_location, retain=retain, storage_options=storage_options)

    def latest_checkpoint(self) -> CheckpointMetadata | None:
        """The latest complete checkpoint, None before the first batch."""
        return self.storage.latest()

    # ---- one micro-batch ----------------------------------------------------------------------------------------

    def _begin(self, parallelism: int, checkpoint_id: int | None = None) -> BatchPlan:
        return begin_batch(self.storage, job_name=self.name, max_parallelism=self.max_parallelism,
                           parallelism=parallelism, checkpoint_id=checkpoint_id)

    def _path(self, relpath: str) -> str:
        """A storage-relative file as Spark reads it: under the location exactly as the job was given it."""
        return f"{self.storage.location.rstrip('/')}/{relpath}"

    def _result(self, spark: SparkSession, metadata: CheckpointMetadata, *, replayed: bool, started: float
                ) -> BatchResult:
        """The committed batch: its output DataFrame reads the files the committed subtasks wrote."""
        schema = from_arrow_schema(self.output_schema)
        if metadata.outputs:
            output = spark.read.schema(schema).parquet(*[self._path(f) for f in metadata.outputs])
        else:
            output = spark.createDataFrame([], schema)
        return BatchResult(metadata.checkpoint_id, metadata.parallelism, output, metadata,
                           metadata.properties.get("reports", []), time.perf_counter() - started, replayed)

    def _run_keyed(self, plan: BatchPlan, df: DataFrame, source_reports: list[dict[str, Any]],
                   properties: dict[str, Any] | None) -> CheckpointMetadata:
        """The keyed stage on Spark: place the records, run one task per subtask, commit."""
        spec = plan.keyed_task(
            key_columns=self.key_columns, function=self._function, input_schema=_input_arrow_schema(df),
            output_schema=self.output_schema, backend=self.backend, order_columns=self.order_by,
            timestamp_column=self.timestamp_column, allow_pickle=self.allow_pickle, local_dir=self.local_dir,
            warm_heap_backends=self.warm_heap_backends,
        )
        placed = partition_by_key_group(df, *self.key_columns, max_parallelism=plan.max_parallelism,
                                        parallelism=plan.parallelism).select(*df.columns)

        def subtask(batches: Any) -> Any:
            index = TaskContext.get().partitionId()  # type: ignore[union-attr]  # always set inside a task
            report = run_keyed_subtask(spec, index, batches)
            yield pa.RecordBatch.from_pylist([{"subtask": index, "report": json.dumps(report)}], schema=_REPORT_ARROW)

        reports = [json.loads(r["report"]) for r in placed.mapInArrow(subtask, _REPORT_SCHEMA).collect()]
        idle = plan.idle_subtasks(reports)
        if idle:
            reports += [json.loads(r) for r in df.sparkSession.sparkContext.parallelize(idle, len(idle)).map(
                lambda index: _idle_report(spec, index)).collect()]
        return commit_batch(plan, reports, source_reports, properties=properties)

    def run_batch(self, df: DataFrame, *, parallelism: int, checkpoint_id: int | None = None,
                  properties: dict[str, Any] | None = None) -> BatchResult:
        """Process the micro-batch ``df`` at ``parallelism`` and commit it as one checkpoint; the output is
        ``run_batch(...).output``. ``properties`` (JSON) are stored in the checkpoint's metadata.

        With an explicit ``checkpoint_id`` (e.g. Spark's streaming batch id) the call is idempotent: a checkpoint
        that is already complete is not processed again; its committed output comes back instead."""
        started = time.perf_counter()
        plan = self._begin(parallelism, checkpoint_id)
        if plan.replay is not None:
            return self._result(df.sparkSession, plan.replay, replayed=True, started=started)
        metadata = self._run_keyed(plan, df, [], properties)
        return self._result(df.sparkSession, metadata, replayed=False, started=started)

    def run_source_batch(self, spark: SparkSession, log_directory: str, *, parallelism: int,
                         record_schema: pa.Schema, max_records_per_subtask: int | None = None) -> BatchResult:
        """One micro-batch whose input is the next records of a partitioned log (:mod:`keygroups.sources`).

        There is no input DataFrame to take the session from, so the session comes first, as in
        ``spark.read...``; the rest is keyword-only, as in :meth:`run_batch`.

        Source subtask *i* (a Spark task) restores its share of the ``(partition, offset)`` pairs from the previous
        checkpoint's operator state — split evenly over this batch's subtasks, whatever the previous parallelism —
        reads up to ``max_records_per_subtask`` records and stages them under ``chk-<n>/``; the keyed stage then
        runs as in :meth:`run_batch`, and the checkpoint commits the new positions with the keyed state. A resumed
        job, at any parallelism, continues exactly where the last complete checkpoint left off."""
        started = time.perf_counter()
        plan = self._begin(parallelism)
        spec = plan.source_task(log_directory, record_schema=record_schema,
                                max_records_per_subtask=max_records_per_subtask)

        def source_subtask(index: int, _: Any) -> Any:
            yield json.dumps(run_source_subtask(spec, index))

        p = plan.parallelism
        reports = [json.loads(r) for r in
                   spark.sparkContext.parallelize(range(p), p).mapPartitionsWithIndex(source_subtask).collect()]
        inputs = [self._path(r["input_file"]) for r in reports if r["input_file"]]
        schema = from_arrow_schema(staged_schema(record_schema))
        df = spark.read.schema(schema).parquet(*inputs) if inputs else spark.createDataFrame([], schema)
        metadata = self._run_keyed(plan, df, reports, None)
        return self._result(spark, metadata, replayed=False, started=started)

    def foreach_batch(self, sink: Callable[[DataFrame, int], None] | None = None, *,
                      parallelism: int) -> Callable[[DataFrame, int], None]:
        """A function for ``stream.writeStream.foreachBatch(...)``: each micro-batch runs through this job with
        Spark's batch id as the checkpoint id, so a batch Spark replays is not applied twice; ``sink`` then gets the
        batch's committed output (the same output again on a replay, for idempotent sinks)."""
        check_parallelism(parallelism, self.max_parallelism)

        def run(df: DataFrame, batch_id: int) -> None:
            result = self.run_batch(df, parallelism=parallelism, checkpoint_id=int(batch_id))
            if sink is not None:
                sink(result.output, int(batch_id))

        return run


def _idle_report(spec: KeyedTaskSpec, index: int) -> str:
    """An idle subtask's run (no records), as a Spark task; its report travels as JSON, as every other report."""
    return json.dumps(run_keyed_subtask(spec, index, []))
