"""The stateful job runner: one micro-batch on Spark is one checkpoint, and every run may use another parallelism.

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
from typing import TYPE_CHECKING, Any

import pyarrow as pa

from keygroups._ranges import check_max_parallelism, check_parallelism
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.checkpoint.planning import check_restore_max_parallelism
from keygroups.errors import KeyGroupsError
from keygroups.runtime.commit import checkpoint_metadata
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.runtime.source import SourceTaskSpec, run_source_subtask, staged_schema
from keygroups.runtime.subtask import KeyedTaskSpec, key_type_for_schema, run_keyed_subtask

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession

_REPORT_SCHEMA = "subtask int, report string"
_REPORT_ARROW = pa.schema([("subtask", pa.int32()), ("report", pa.string())])


def _arrow_schema(schema: Any) -> pa.Schema:
    """A pyarrow schema from a pyarrow Schema, a Spark StructType or a DDL string."""
    if isinstance(schema, pa.Schema):
        return schema
    from pyspark.sql.pandas.types import to_arrow_schema
    from pyspark.sql.types import StructType, _parse_datatype_string

    if isinstance(schema, str):
        schema = _parse_datatype_string(schema)
    if not isinstance(schema, StructType):
        raise TypeError(f"output_schema must be a pyarrow Schema, a Spark StructType or a DDL string, got {schema!r}")
    return to_arrow_schema(schema)


def _spark_schema(schema: pa.Schema) -> Any:
    from pyspark.sql.pandas.types import from_arrow_schema

    return from_arrow_schema(schema)


def _pickle_function(function: KeyedProcessFunction) -> bytes:
    if not isinstance(function, KeyedProcessFunction):
        raise TypeError(f"function must be a KeyedProcessFunction instance, got {type(function).__name__}")
    from pyspark import cloudpickle  # what Spark itself ships functions with (classes defined in __main__ too)

    return cloudpickle.dumps(function)


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
    that form the key (several form a Flink tuple); ``order_by`` names columns that order a key's records inside a
    batch (Spark's shuffle keeps no order, so give one whenever order matters to the function).
    """

    def __init__(
        self,
        name: str,
        key_columns: Sequence[str] | str,
        function: KeyedProcessFunction,
        output_schema: Any,
        max_parallelism: int,
        checkpoint_location: str,
        *,
        backend: str = "heap",
        order_by: Sequence[str] = (),
        timestamp_column: str | None = None,
        retain: int = 3,
        storage_options: dict[str, Any] | None = None,
        allow_pickle: bool = False,
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
        self.storage_options = storage_options
        self.allow_pickle = allow_pickle
        self.storage = CheckpointStorage(checkpoint_location, retain=retain, storage_options=storage_options)

    # ---- checkpoints --------------------------------------------------------------------------------------------

    def latest_checkpoint(self) -> CheckpointMetadata | None:
        return self.storage.latest()

    def _check_restorable(self, previous: CheckpointMetadata | None) -> None:
        if previous is not None:
            check_restore_max_parallelism(previous, self.max_parallelism)

    def _output_path(self, relpath: str) -> str:
        return f"{self.storage.location.rstrip('/')}/{relpath}"

    def _committed_result(self, spark: SparkSession, metadata: CheckpointMetadata, *, replayed: bool,
                          reports: list[dict[str, Any]] | None = None, seconds: float = 0.0) -> BatchResult:
        outputs = metadata.properties.get("outputs", [])
        schema = _spark_schema(self.output_schema)
        if outputs:
            output = spark.read.schema(schema).parquet(*[self._output_path(p) for p in outputs])
        else:
            output = spark.createDataFrame([], schema)
        return BatchResult(metadata.checkpoint_id, metadata.parallelism, output, metadata,
                           reports if reports is not None else metadata.properties.get("reports", []),
                           seconds, replayed)

    def _next_checkpoint_id(self, previous: CheckpointMetadata | None, checkpoint_id: int | None) -> int:
        if checkpoint_id is None:
            return previous.checkpoint_id + 1 if previous is not None else 1
        if isinstance(checkpoint_id, bool) or not isinstance(checkpoint_id, int) or checkpoint_id < 0:
            raise ValueError(f"checkpoint_id must be an int >= 0, got {checkpoint_id!r}")
        if previous is not None and checkpoint_id < previous.checkpoint_id:
            raise KeyGroupsError(
                f"checkpoint {checkpoint_id} is older than the latest complete checkpoint {previous.checkpoint_id} "
                f"and is no longer retained (retained: {self.storage.checkpoint_ids()}): it cannot be replayed"
            )
        return checkpoint_id

    # ---- one micro-batch ----------------------------------------------------------------------------------------

    def run_batch(self, spark: SparkSession, df: DataFrame, parallelism: int, *,
                  checkpoint_id: int | None = None, source_reports: list[dict[str, Any]] | None = None,
                  properties: dict[str, Any] | None = None) -> BatchResult:
        """Process one micro-batch at ``parallelism`` and commit it as one checkpoint.

        With an explicit ``checkpoint_id`` (e.g. Spark's streaming batch id) the call is idempotent: a checkpoint
        that is already complete is not processed again; its committed output comes back instead."""
        started = time.perf_counter()
        p, mp = check_parallelism(parallelism, self.max_parallelism)
        if checkpoint_id is not None and checkpoint_id in self.storage.checkpoint_ids():
            return self._committed_result(spark, self.storage.load(checkpoint_id), replayed=True)
        previous = self.storage.latest()
        self._check_restorable(previous)
        cid = self._next_checkpoint_id(previous, checkpoint_id)

        from pyspark.sql.pandas.types import to_arrow_schema

        from keygroups.spark.partitioner import partition_by_key_group

        input_schema = to_arrow_schema(df.schema)
        key_type = key_type_for_schema(input_schema, self.key_columns)
        spec = KeyedTaskSpec(
            job_name=self.name, key_columns=self.key_columns, key_type=key_type, function=self._function,
            input_schema=input_schema, output_schema=self.output_schema, max_parallelism=mp, parallelism=p,
            checkpoint_location=self.storage.location, checkpoint_id=cid,
            restore_from=previous.checkpoint_id if previous is not None else None, backend=self.backend,
            order_columns=self.order_by, timestamp_column=self.timestamp_column,
            storage_options=self.storage_options, allow_pickle=self.allow_pickle,
        )
        placed = partition_by_key_group(df, *self.key_columns, max_parallelism=mp, parallelism=p)
        placed = placed.select(*df.columns)

        def subtask(batches: Any) -> Any:
            from pyspark import TaskContext

            index = TaskContext.get().partitionId()
            report = run_keyed_subtask(spec, index, batches)
            yield pa.RecordBatch.from_pylist([{"subtask": index, "report": json.dumps(report)}], schema=_REPORT_ARROW)

        reports = [json.loads(r["report"]) for r in placed.mapInArrow(subtask, _REPORT_SCHEMA).collect()]
        # Spark runs no task for an input it knows is empty (it prunes the whole plan), but every subtask must still
        # carry its key groups' state into the new checkpoint: those subtasks run here with no records.
        missing = sorted(set(range(p)) - {r["subtask"] for r in reports})
        if missing:
            def idle_subtask(index: int) -> str:
                return json.dumps(run_keyed_subtask(spec, index, []))

            sc = spark.sparkContext
            reports += [json.loads(r) for r in sc.parallelize(missing, len(missing)).map(idle_subtask).collect()]
        metadata = checkpoint_metadata(job_name=self.name, checkpoint_id=cid, max_parallelism=mp, parallelism=p,
                                       keyed_reports=reports, source_reports=source_reports or (),
                                       properties=properties)
        self.storage.commit(metadata)
        return self._committed_result(spark, metadata, replayed=False, reports=reports,
                                      seconds=time.perf_counter() - started)

    def run_source_batch(self, spark: SparkSession, log_directory: str, parallelism: int, *,
                         record_schema: pa.Schema, max_records_per_subtask: int | None = None) -> BatchResult:
        """One micro-batch whose input is the next records of a partitioned log (:mod:`keygroups.sources`).

        Source subtask *i* (a Spark task) restores its share of the ``(partition, offset)`` pairs from the previous
        checkpoint's operator state — split evenly over this batch's subtasks, whatever the previous parallelism —
        reads up to ``max_records_per_subtask`` records and stages them under ``chk-<n>/``; the keyed stage then
        runs as in :meth:`run_batch`, and the checkpoint commits the new positions with the keyed state. A resumed
        job, at any parallelism, continues exactly where the last complete checkpoint left off."""
        started = time.perf_counter()
        p, _ = check_parallelism(parallelism, self.max_parallelism)
        previous = self.storage.latest()
        self._check_restorable(previous)
        cid = self._next_checkpoint_id(previous, None)
        spec = SourceTaskSpec(
            log_directory=str(log_directory), record_schema=record_schema, parallelism=p,
            max_records=max_records_per_subtask, checkpoint_location=self.storage.location, checkpoint_id=cid,
            restore_from=previous.checkpoint_id if previous is not None else None,
            storage_options=self.storage_options,
        )

        def source_subtask(index: int, _: Any) -> Any:
            yield json.dumps(run_source_subtask(spec, index))

        reports = [json.loads(r) for r in
                   spark.sparkContext.parallelize(range(p), p).mapPartitionsWithIndex(source_subtask).collect()]
        inputs = [self._output_path(r["input_file"]) for r in reports if r["input_file"]]
        schema = _spark_schema(staged_schema(record_schema))
        df = spark.read.schema(schema).parquet(*inputs) if inputs else spark.createDataFrame([], schema)
        result = self.run_batch(spark, df, p, checkpoint_id=cid, source_reports=reports)
        result.seconds = time.perf_counter() - started
        return result

    def process_batch(self, spark: SparkSession, df: DataFrame, parallelism: int, *,
                      checkpoint_id: int | None = None) -> DataFrame:
        """:meth:`run_batch`, returning just the output DataFrame."""
        return self.run_batch(spark, df, parallelism, checkpoint_id=checkpoint_id).output

    def foreach_batch(self, sink: Callable[[DataFrame, int], None] | None = None, *,
                      parallelism: int) -> Callable[[DataFrame, int], None]:
        """A function for ``stream.writeStream.foreachBatch(...)``: each micro-batch runs through this job with
        Spark's batch id as the checkpoint id, so a batch Spark replays is not applied twice; ``sink`` then gets the
        batch's committed output (the same output again on a replay, for idempotent sinks)."""
        check_parallelism(parallelism, self.max_parallelism)

        def run(df: DataFrame, batch_id: int) -> None:
            result = self.run_batch(df.sparkSession, df, parallelism, checkpoint_id=int(batch_id))
            if sink is not None:
                sink(result.output, int(batch_id))

        return run
