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

Those files (the output, and a source batch's staged input) are read by :func:`read_checkpoint_files`: with Spark's
own Parquet reader where Hadoop reaches the checkpoint location as the tasks did (a local path, ``hdfs://``), and
otherwise by Spark tasks that read each file through the checkpoint storage, with the job's ``storage_options``
(``s3://`` without Hadoop's S3A connector, or with an endpoint and credentials Hadoop is not configured with).
"""

from __future__ import annotations

import contextlib
import datetime
import difflib
import inspect
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark import StorageLevel, TaskContext, cloudpickle
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
from pyspark.sql.types import (
    ArrayType,
    IntegralType,
    MapType,
    StructType,
    TimestampNTZType,
    TimestampType,
    _parse_datatype_string,
)

from keygroups._ranges import check_max_parallelism, check_parallelism
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.errors import CheckpointNotFoundError, ReplayMismatchError
from keygroups.runtime.assignment import DECISION_PROPERTY, Assignment, resolve_assignment
from keygroups.runtime.driver import BatchPlan, DriverFence, begin_batch, commit_batch
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.runtime.report import BatchReport, format_time
from keygroups.runtime.scaling import HISTORY, BatchFigures, ParallelismPolicy
from keygroups.runtime.source import Source, run_source_subtask
from keygroups.runtime.subtask import (
    KeyedTaskSpec,
    check_restored_states,
    check_warm_heap_backends,
    key_type_for_schema,
    run_keyed_subtask,
    unused_name,
)
from keygroups.runtime.watermarks import WatermarkStrategy, check_late_records
from keygroups.spark.metrics import record_spark_batch  # metrics (issue 36)
from keygroups.spark.partitioner import partition_by_key_group
from keygroups.state.timers import NO_WATERMARK

#: Every batch's INFO line and late-data WARNING.
LOG = logging.getLogger("keygroups")

_REPORT_SCHEMA = "subtask int, report string"
_REPORT_ARROW = pa.schema([("subtask", pa.int32()), ("report", pa.string())])
_TASK_SCHEMA = "index long, report string"
_TASK_ARROW = pa.schema([("index", pa.int64()), ("report", pa.string())])
#: The per-record input digest column, added before the shuffle and removed before the function sees the records.
_DIGEST = "__keygroups_input_digest"
_U64 = 1 << 64
#: The savepoint a job's checkpoints descend from: a restarted driver given the same savepoint continues from its
#: latest checkpoint instead of going back to the savepoint.
_LINEAGE = "started_from_savepoint"


def _quoted(name: str) -> Column:
    return F.col("`" + name.replace("`", "``") + "`")


def _record_digest(df: DataFrame) -> Column:
    """Spark's xxhash64 of a record over all its columns (a map by its sorted entries: Spark refuses to hash maps)."""
    columns = [F.array_sort(F.map_entries(_quoted(f.name))) if isinstance(f.dataType, MapType) else _quoted(f.name)
               for f in df.schema.fields]
    return F.xxhash64(*columns)


def input_digest(df: DataFrame) -> dict[str, int]:
    """What identifies a batch's records, whatever their order and partitioning: their count and the sum (mod 2^64)
    of each record's xxhash64. A replay compares it with the digest its checkpoint committed."""
    row = df.select(F.count(F.lit(1)).alias("n"),
                    F.sum(_record_digest(df).cast("decimal(20,0)")).alias("s")).collect()[0]
    return {"records": int(row["n"]), "xxhash64_sum": int(row["s"] or 0) % _U64}


class _DigestedBatches:
    """A subtask's input batches without the digest column, summing the digest on the way (mod 2^64)."""

    def __init__(self, batches: Any, column: str = _DIGEST, names: list[str] | None = None) -> None:
        self._batches = batches
        self._column = column
        self._names = names   # the input's own column names, where they crossed under others
        self.records = 0
        self.total = 0

    def __iter__(self) -> Any:
        for batch in self._batches:
            i = batch.schema.get_field_index(self._column)
            digests = batch.column(i).to_numpy(zero_copy_only=False).astype(np.uint64, copy=False)
            self.total = (self.total + int(digests.sum(dtype=np.uint64))) % _U64
            self.records += batch.num_rows
            batch = batch.drop_columns([self._column])
            yield batch if self._names is None else pa.RecordBatch.from_arrays(batch.columns, names=self._names)


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


# Schemes whose files Spark's own Parquet reader reaches exactly as the tasks wrote them, with nothing from the job's
# storage_options: local paths (CheckpointStorage makes them absolute, without a scheme) and HDFS, whose address is
# all in the URL. Any other URL is read through the checkpoint storage: the tasks wrote through it, so it reaches
# the files, where Hadoop may lack the connector (s3:// without S3A) or the endpoint and credentials.
_SPARK_READER_SCHEMES = frozenset({"file", "hdfs", "viewfs"})

FileReader = Literal["auto", "spark", "storage"]
#: The keyed state backends a job runs on.
Backend = Literal["heap", "rocksdb"]
_BACKENDS = ("heap", "rocksdb")
#: What happens to records at or before the watermark.
LateRecords = Literal["drop", "output"]


def _scheme(location: str) -> str:
    return location.split("://", 1)[0].lower() if "://" in location else "file"


def _read_parquet_file(storage: CheckpointStorage, relpath: str, schema: pa.Schema) -> Any:
    """The record batches of one Parquet file under ``storage``, as ``schema`` (timestamps as the task wrote them,
    UTC instants)."""
    buffer = storage.open_buffer(relpath)   # one whole-object GET on object stores: no listing, no HEAD
    for batch in pq.ParquetFile(pa.BufferReader(buffer)).iter_batches():
        yield batch if batch.schema.equals(schema) else batch.cast(schema)


def read_checkpoint_files(spark: SparkSession, storage: CheckpointStorage, files: Sequence[str], schema: pa.Schema,
                          *, reader: FileReader = "auto") -> DataFrame:
    """The Parquet files ``files`` (relative to ``storage``'s location: a batch's output or staged input) as one
    lazy DataFrame of ``schema``; evaluating it again reads the files again.

    ``reader="spark"`` is Spark's own Parquet reader over ``<location>/<file>`` (Hadoop must reach the location);
    ``"storage"`` reads in Spark tasks, one per file, through ``storage`` with its ``storage_options``, as the tasks
    that wrote them did; ``"auto"`` takes Spark's reader for local paths and ``hdfs://`` (faster: no Python worker,
    no Arrow hand-over) and the storage for every other URL (``s3://``, ``gs://``, ...)."""
    spark_schema = from_arrow_schema(schema)
    if not files:
        return spark.createDataFrame([], spark_schema)
    if reader == "auto":
        reader = "spark" if _scheme(storage.location) in _SPARK_READER_SCHEMES else "storage"
    if reader == "spark":
        base = storage.location.rstrip("/")
        return spark.read.schema(spark_schema).parquet(*[f"{base}/{f}" for f in files])
    if reader != "storage":
        raise ValueError(f"reader must be 'auto', 'spark' or 'storage', got {reader!r}")

    files = list(files)

    def read(batches: Any) -> Any:
        for batch in batches:
            for index in batch.column(0).to_pylist():
                yield from _read_parquet_file(storage, files[index], schema)

    return _one_task_each(spark, len(files)).mapInArrow(read, spark_schema)


def _one_task_each(spark: SparkSession, n: int) -> DataFrame:
    """The ids ``0..n-1`` in ``n`` partitions, one id each: a DataFrame whose ``mapInArrow`` runs one Spark task per
    item. Built from ``spark.range``, so it works on classic sessions and over Spark Connect alike (Connect has no
    SparkContext to ``parallelize`` with)."""
    return spark.range(0, n, 1, n)


def _run_tasks(spark: SparkSession, n: int, task: Callable[[int], str]) -> list[str]:
    """``task(i)`` for every ``i`` in ``0..n-1``, each in its own Spark task, in the order of ``i``; a task returns
    a string (a JSON report)."""
    def run(batches: Any) -> Any:
        for batch in batches:
            for index in batch.column(0).to_pylist():
                yield pa.RecordBatch.from_pylist([{"index": index, "report": task(index)}], schema=_TASK_ARROW)

    rows = _one_task_each(spark, n).mapInArrow(run, _TASK_SCHEMA).collect()
    return [r["report"] for r in sorted(rows, key=lambda r: r["index"])]


def _pickle_function(function: KeyedProcessFunction) -> bytes:
    if not isinstance(function, KeyedProcessFunction):
        raise TypeError(f"function must be a KeyedProcessFunction instance, got {type(function).__name__}")
    return cloudpickle.dumps(function)  # as Spark ships functions: classes defined in __main__ travel too


@dataclass
class BatchResult:
    """What one micro-batch did: its committed checkpoint, its output, its figures (``report``, a
    :class:`~keygroups.runtime.report.BatchReport`) and the raw per-subtask reports they come from."""

    checkpoint_id: int
    parallelism: int
    output: DataFrame
    metadata: CheckpointMetadata
    reports: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0
    replayed: bool = False
    #: The records that arrived behind the watermark, with ``late_records="output"`` (None otherwise).
    late_output: DataFrame | None = None
    #: The batch in figures: records in, late and out, the watermark, restore modes, bytes, timers, phase times.
    report: BatchReport = None  # type: ignore[assignment]  # always set by the job; None only if built by hand

    def __post_init__(self) -> None:
        if self.report is None:
            self.report = BatchReport.from_checkpoint(self.metadata, replayed=self.replayed)

    @property
    def watermark(self) -> int:
        """The batch's watermark (epoch ms; ``NO_WATERMARK`` before any event time), where the next batch starts."""
        return int(self.metadata.properties.get("watermark", NO_WATERMARK))

    @property
    def records_late(self) -> int:
        """Records at or before the watermark the batch started with: dropped, or in ``late_output``."""
        return int(self.metadata.properties.get("records_late", 0))

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
    by default). ``restore_from_savepoint`` names a savepoint in ``checkpoint_location`` (see :meth:`savepoint`)
    that the job's first batch restores instead of the latest checkpoint, at any parallelism; the checkpoints after
    it say so, and a driver restarted with the same argument continues from the latest of them (Flink's ``-s``,
    no-claim mode). ``late_warning_share`` is the share of a batch's records that may be late before the batch logs
    a WARNING on the ``keygroups`` logger (every batch logs one INFO line, its :class:`BatchReport`).

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
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string (the job's name in its checkpoints), got {name!r}")
        self.name = name
        self.key_columns = _column_names("key_columns", key_columns)
        if not self.key_columns:
            raise ValueError("key_columns must name at least one input column (several form a Flink tuple key), "
                             "got none")
        self.max_parallelism = check_max_parallelism(max_parallelism)
        # A DDL string needs a Spark session to parse: without one it is parsed at the first batch, so that a job
        # can be built before the session exists.
        self._output_schema: pa.Schema | None = None
        self._output_ddl: str | None = None
        if isinstance(output_schema, str) and SparkSession.getActiveSession() is None:
            self._output_ddl = output_schema
        else:
            self._output_schema = _arrow_schema(output_schema)
        self._function = _pickle_function(function)
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
        self.storage = CheckpointStorage(checkpoint_location, retain=retain, storage_options=storage_options)
        self._fence: DriverFence | None = None   # claimed at the first batch: constructing a job fences nobody
        self.restore_from_savepoint = restore_from_savepoint
        #: Read each batch's input once (persisted while its count and largest event time are found). False runs
        #: the former path, a Spark job per figure, for the comparison in benchmarks/bench_runner.py only.
        self._read_input_once = True
        #: The restore point whose state declarations were checked on the driver against the function's.
        self._checked_restore_point: tuple[Any, ...] | None = None
        self._savepoint_pending = restore_from_savepoint is not None
        self.assignment = resolve_assignment(assignment)

    @property
    def output_schema(self) -> pa.Schema:
        """The schema of the function's output records (a DDL string given without a Spark session is parsed here,
        at the first batch)."""
        if self._output_schema is None:
            assert self._output_ddl is not None
            self._output_schema = _arrow_schema(self._output_ddl)
            _check_declared_output(self._declared_output, self._output_schema)
        return self._output_schema

    def _check_input(self, df: DataFrame) -> None:
        """Refuse, on the driver and before any Spark job, an input the job's columns do not fit: each error names
        the argument, the value and what the input has."""
        fields = {f.name: f.dataType for f in df.schema.fields}
        available = f"the input's columns are {list(fields)}"
        for argument, names in (("key_columns", self.key_columns), ("order_by", self.order_by)):
            for column in names:
                if column not in fields:
                    raise ValueError(f"{argument}: column {column!r} is not in the input; {available}")
        input_schema = _input_arrow_schema(df)
        key_type_for_schema(input_schema, self.key_columns)   # TypeError naming the column and the allowed types
        for column in self.order_by:
            kind = fields[column]
            if isinstance(kind, (MapType, ArrayType, StructType)):
                raise TypeError(f"order_by: column {column!r} is {kind.simpleString()}, which has no order; allowed: "
                                "numbers, strings, binary, booleans, dates and timestamps")
        if self.timestamp_column is not None:
            if self.timestamp_column not in fields:
                raise ValueError(f"timestamp_column: column {self.timestamp_column!r} is not in the input; "
                                 f"{available}")
            _event_time_column(df, self.timestamp_column)   # TypeError naming the type and the allowed ones

    def _check_restore_point(self, plan: BatchPlan, input_schema: pa.Schema) -> None:
        """Open the function's state declarations on the driver against the restore point's state metas (once per
        restore point this driver did not write itself): a changed serializer, kind or TTL raises
        StateMigrationError here, before any task runs, rather than in every task. The function's ``open`` runs
        against an empty heap backend holding the restored metas only (no state is read)."""
        previous = plan.previous
        if previous is None or not previous.keyed_handles:
            return
        point = (previous.checkpoint_id, plan.savepoint)
        if point == self._checked_restore_point:
            return
        key_type = key_type_for_schema(input_schema, self.key_columns)
        check_restored_states(self._function, previous, key_type=key_type, job_name=self.name,
                              max_parallelism=plan.max_parallelism, allow_pickle=self.allow_pickle,
                              checkpoint_id=plan.checkpoint_id)
        self._checked_restore_point = point

    def latest_checkpoint(self) -> CheckpointMetadata | None:
        """The latest complete checkpoint, None before the first batch."""
        return self.storage.latest()

    # ---- one micro-batch ----------------------------------------------------------------------------------------

    def _begin(self, parallelism: int, checkpoint_id: int | None = None) -> BatchPlan:
        """Plan a batch as this job's driver: the first batch claims the location (fencing any earlier driver of
        it); a later driver's claim fences this one (DriverFencedError, nothing committed)."""
        if self._fence is None:
            self._fence = DriverFence.claim(self.storage, self.name)
        savepoint = None
        if self._savepoint_pending:
            latest = self.storage.latest()
            lineage = latest.properties.get(_LINEAGE) if latest is not None else None
            savepoint = None if lineage == self.restore_from_savepoint else self.restore_from_savepoint
        return begin_batch(self.storage, job_name=self.name, max_parallelism=self.max_parallelism,
                           parallelism=parallelism, checkpoint_id=checkpoint_id, fence=self._fence,
                           savepoint=savepoint, assignment=self.assignment)

    def savepoint(self, name: str) -> str:
        """Take a savepoint of the latest complete checkpoint, between batches: a self-contained full snapshot in
        ``savepoints/<name>/`` that retention never deletes and either backend restores (start a job from it with
        ``restore_from_savepoint=name``). Returns its directory."""
        latest = self.storage.latest()
        if latest is None:
            raise CheckpointNotFoundError(f"job {self.name!r} has no complete checkpoint in "
                                          f"{self.storage.location} yet: run a batch before taking a savepoint")
        return self.storage.savepoint(latest, name)

    def _result(self, spark: SparkSession, metadata: CheckpointMetadata, *, replayed: bool, started: float,
                input_schema: pa.Schema, commit_seconds: float | None = None) -> BatchResult:
        """The committed batch: its output DataFrame reads the files the committed subtasks wrote (its late output
        those of the late records, of ``input_schema``)."""
        output = read_checkpoint_files(spark, self.storage, metadata.outputs, self.output_schema)
        late = None
        if self.late_records == "output":
            late = read_checkpoint_files(spark, self.storage, metadata.late_outputs, input_schema)
        report = BatchReport.from_checkpoint(metadata, replayed=replayed, commit_seconds=commit_seconds)
        return BatchResult(metadata.checkpoint_id, metadata.parallelism, output, metadata,
                           metadata.properties.get("reports", []), time.perf_counter() - started, replayed,
                           late_output=late, report=report)

    def _run_keyed(self, plan: BatchPlan, df: DataFrame, source_reports: list[dict[str, Any]],
                   properties: dict[str, Any] | None, *, max_event: int | None,
                   plan_started: float) -> tuple[CheckpointMetadata, float]:
        """The keyed stage on Spark: place the records, run one task per subtask, commit. ``max_event`` is the
        batch's largest event time (found with the batch's count, in the one read of the input before this stage).
        Returns the committed metadata and the commit's seconds."""
        watermark = None
        if self.watermark_strategy is not None:
            watermark = self.watermark_strategy.next_watermark(plan.start_watermark, max_event)
        spec = plan.keyed_task(
            key_columns=self.key_columns, function=self._function, input_schema=_input_arrow_schema(df),
            output_schema=self.output_schema, backend=self.backend, order_columns=self.order_by,
            timestamp_column=self.timestamp_column, allow_pickle=self.allow_pickle, local_dir=self.local_dir,
            warm_heap_backends=self.warm_heap_backends, watermark=watermark, late_records=self.late_records,
        )
        digest_column = unused_name(df.columns, _DIGEST)
        # PySpark's mapInArrow refers to its input's columns by their bare names, which breaks on a name with a dot
        # or a backtick: such columns cross it under plain names, and get theirs back in the task.
        names = list(df.columns)
        plain = [unused_name(names, f"__kg_column_{i}") if "." in c or "`" in c else c
                 for i, c in enumerate(names)]
        placed = partition_by_key_group(df.withColumn(digest_column, _record_digest(df)), *self.key_columns,
                                        max_parallelism=plan.max_parallelism, parallelism=plan.parallelism,
                                        key_group_boundaries=plan.boundaries
                                        ).select(*[_quoted(c).alias(p) for c, p in zip(names, plain)],
                                                 _quoted(digest_column))

        def subtask(batches: Any) -> Any:
            index = TaskContext.get().partitionId()  # type: ignore[union-attr]  # always set inside a task
            digested = _DigestedBatches(batches, digest_column, names if plain != names else None)
            report = run_keyed_subtask(spec, index, digested)
            report["input_digest"] = {"records": digested.records, "xxhash64_sum": digested.total}
            yield pa.RecordBatch.from_pylist([{"subtask": index, "report": json.dumps(report)}], schema=_REPORT_ARROW)

        plan_seconds = time.perf_counter() - plan_started
        reports = [json.loads(r["report"]) for r in placed.mapInArrow(subtask, _REPORT_SCHEMA).collect()]
        idle = plan.idle_subtasks(reports)
        if idle:
            reports += [json.loads(r) for r in
                        _run_tasks(df.sparkSession, len(idle), lambda i: _idle_report(spec, idle[i]))]
        digests = [r.get("input_digest", {"records": 0, "xxhash64_sum": 0}) for r in reports]
        digest = {"records": sum(d["records"] for d in digests),
                  "xxhash64_sum": sum(d["xxhash64_sum"] for d in digests) % _U64}
        lineage = {_LINEAGE: self.restore_from_savepoint} if self.restore_from_savepoint is not None else {}
        figures = {"start_watermark": plan.start_watermark, "driver_seconds": {"plan": plan_seconds}}
        committing = time.perf_counter()
        metadata = commit_batch(plan, reports, source_reports,
                                properties={**(properties or {}), "input_digest": digest, **lineage, **figures},
                                watermark=watermark)
        self._savepoint_pending = False
        self._checked_restore_point = (metadata.checkpoint_id, None)   # written here, by this very function
        commit_seconds = time.perf_counter() - committing
        record_spark_batch(self, df.sparkSession, self.storage, metadata, reports, plan.previous,  # metrics (issue 36)
                           started=plan_started, commit_seconds=commit_seconds)   # (never raises)
        return metadata, commit_seconds

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
        return self._run(df, parallelism, checkpoint_id, properties, ())

    def _run(self, df: DataFrame, parallelism: int | ParallelismPolicy, checkpoint_id: int | None,
             properties: dict[str, Any] | None, history: Sequence[BatchFigures]) -> BatchResult:
        started = time.perf_counter()
        policy = _checked_parallelism(parallelism, self.max_parallelism)
        self.output_schema   # noqa: B018  # a DDL string given without a session is parsed (and checked) now
        self._check_input(df)
        plan = self._begin(1 if policy is not None else int(parallelism), checkpoint_id)  # type: ignore[arg-type]
        input_schema = _input_arrow_schema(df)
        if plan.replay is not None:
            _check_replay(plan.replay, df)
            result = self._result(df.sparkSession, plan.replay, replayed=True, started=started,
                                  input_schema=input_schema)
            self._log(result.report)
            return result
        self._check_restore_point(plan, input_schema)
        with self._read_once(df, count=policy is not None) as (df, records, max_event):
            if policy is not None:
                assert records is not None
                p = _checked_choice(policy, policy(records, tuple(history[-HISTORY:])), records,
                                    self.max_parallelism)
                properties = {**(properties or {}),
                              "parallelism_policy": {"policy": repr(policy), "records": records, "chose": p}}
                plan = plan.at_parallelism(p, self.assignment)
            metadata, commit_seconds = self._run_keyed(plan, df, [], properties, max_event=max_event,
                                                       plan_started=started)
        result = self._result(df.sparkSession, metadata, replayed=False, started=started,
                              input_schema=input_schema, commit_seconds=commit_seconds)
        self._log(result.report)
        return result

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
        parallelism, continues exactly where the last complete checkpoint left off."""
        started = time.perf_counter()
        plan = self._begin(parallelism)
        spec = plan.source_task(source, record_schema=record_schema,
                                max_records_per_subtask=max_records_per_subtask)
        staged = spec.staged_schema
        self._check_restore_point(plan, staged)

        reports = [json.loads(r) for r in
                   _run_tasks(spark, plan.parallelism, lambda index: json.dumps(run_source_subtask(spec, index)))]
        inputs = [r["input_file"] for r in reports if r["input_file"]]
        df = read_checkpoint_files(spark, self.storage, inputs, staged)
        self._check_input(df)
        with self._read_once(df, count=False) as (df, _, max_event):
            metadata, commit_seconds = self._run_keyed(plan, df, reports, None, max_event=max_event,
                                                       plan_started=started)
        spec.source.notify_checkpoint_complete(metadata)
        result = self._result(spark, metadata, replayed=False, started=started,
                              input_schema=staged, commit_seconds=commit_seconds)
        self._log(result.report)
        return result

    @contextlib.contextmanager
    def _read_once(self, df: DataFrame, *, count: bool) -> Iterator[tuple[DataFrame, int | None, int | None]]:
        """``(df, records, max_event)`` for a batch's keyed stage: the record count (if ``count``) and the largest
        event time (with a watermark strategy) found in one Spark job, over ``df`` persisted so that the keyed
        stage reads the same rows again instead of the source; released when the block ends. A ``df`` the caller
        cached stays as it is. Persisting costs one columnar copy of the batch (in executor memory, spilling to
        disk); a second read of the source costs its whole read and parse, each time."""
        need_max = self.watermark_strategy is not None
        if not (count or need_max):
            yield df, None, None
            return
        column = self.timestamp_column if need_max else None
        if not self._read_input_once:   # the former path, for the comparison in benchmarks/bench_runner.py
            records = df.count() if count else None
            yield df, records, max_event_time(df, column) if column is not None else None
            return
        persisted = not df.is_cached
        if persisted:
            df = df.persist(StorageLevel.MEMORY_AND_DISK)
        try:
            records, max_event = _count_and_max_event_time(df, column)
            yield df, records, max_event
        finally:
            if persisted:
                df.unpersist()

    def _log(self, report: BatchReport) -> None:
        """One INFO line per batch; a WARNING when more than ``late_warning_share`` of its records were late."""
        LOG.info("job %s: %s", self.name, report)
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
        """A function for ``stream.writeStream.foreachBatch(...)``: each micro-batch runs through this job with
        Spark's batch id as the checkpoint id, so a batch Spark replays is not applied twice; ``sink`` then gets the
        batch's committed output (the same output again on a replay, for idempotent sinks).

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
        wants_result = sink is not None and _takes_three_arguments(sink)
        history: list[BatchFigures] = []

        def run(df: DataFrame, batch_id: int) -> None:
            result = self._run(df, parallelism, int(batch_id), None, history)
            if not result.replayed:
                decision = result.metadata.properties.get(DECISION_PROPERTY) or {}
                history.append(BatchFigures(result.checkpoint_id, result.parallelism, result.records_in,
                                            result.seconds, decision.get("max_over_mean")))
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
    if callable(parallelism):
        return parallelism  # type: ignore[no-any-return]
    check_parallelism(parallelism, max_parallelism)
    return None


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


def _event_time_column(df: DataFrame, column: str) -> Column:
    """The aggregate-ready form of the event-time column: epoch microseconds of a timestamp, the raw value of a
    TIMESTAMP_NTZ (converted on the driver) or of an integer (epoch ms)."""
    kind = df.schema[column].dataType
    c = _quoted(column)
    if isinstance(kind, TimestampType):
        return F.unix_micros(c)
    if isinstance(kind, (TimestampNTZType, IntegralType)):
        return c
    raise TypeError(f"timestamp_column {column!r} is {kind.simpleString()}; allowed: a timestamp, or an integral "
                    "column of epoch milliseconds")


def _event_time_millis(df: DataFrame, column: str, value: Any) -> int | None:
    """The maximum :func:`_event_time_column` found, as epoch ms (None when the column held no value)."""
    if value is None:
        return None
    kind = df.schema[column].dataType
    if isinstance(kind, TimestampType):
        return int(value) // 1000
    if isinstance(kind, TimestampNTZType):
        return (value - datetime.datetime(1970, 1, 1)) // datetime.timedelta(milliseconds=1)  # type: ignore[no-any-return]
    return int(value)


def _count_and_max_event_time(df: DataFrame, column: str | None) -> tuple[int, int | None]:
    """The batch's record count and, with a ``column``, its largest event time (epoch ms): one Spark job."""
    aggregates = [F.count(F.lit(1))]
    if column is not None:
        aggregates.append(F.max(_event_time_column(df, column)))
    row = df.agg(*aggregates).collect()[0]
    return int(row[0]), (_event_time_millis(df, column, row[1]) if column is not None else None)


def max_event_time(df: DataFrame, column: str) -> int | None:
    """The largest event time of ``df``'s ``column`` in epoch ms, as the subtasks read it from Arrow (a timestamp
    with a time zone: its instant; without one (TIMESTAMP_NTZ): its wall-clock time taken as UTC; an integer: its
    value); None when the column holds no value. One Spark aggregation over the batch's input."""
    if column not in df.columns:
        raise ValueError(f"timestamp_column {column!r} is not in the input; its columns are {df.columns}")
    row = df.agg(F.max(_event_time_column(df, column))).first()
    return None if row is None else _event_time_millis(df, column, row[0])


def _checked_choice(policy: ParallelismPolicy, chosen: Any, records: int, max_parallelism: int) -> int:
    """The policy's answer if it is a usable parallelism; a ValueError naming the policy and the bounds otherwise."""
    if isinstance(chosen, bool) or not isinstance(chosen, int) or not 1 <= chosen <= max_parallelism:
        raise ValueError(f"parallelism policy {policy!r} chose {chosen!r} for a batch of {records} records; a "
                         f"parallelism is an int in [1, {max_parallelism}] (the job's max parallelism)")
    return chosen


def _check_replay(replayed: CheckpointMetadata, df: DataFrame) -> None:
    """ReplayMismatchError unless ``df`` holds the records checkpoint ``replayed`` committed (a checkpoint written
    before digests were recorded is taken on trust, as before)."""
    committed = replayed.properties.get("input_digest")
    if not isinstance(committed, dict):
        return
    given = input_digest(df)
    if given != {"records": committed.get("records"), "xxhash64_sum": committed.get("xxhash64_sum")}:
        raise ReplayMismatchError(
            f"checkpoint {replayed.checkpoint_id} is already complete (job {replayed.job_id!r}), committed from "
            f"{committed.get('records')} records with digest {committed.get('xxhash64_sum')}, but this batch has "
            f"{given['records']} records with digest {given['xxhash64_sum']}: a batch id may only be replayed with "
            "the same records (as Spark replays a foreachBatch id). Nothing was processed; give new input a new "
            "checkpoint id, or none to take the next one")


def _idle_report(spec: KeyedTaskSpec, index: int) -> str:
    """An idle subtask's run (no records), as a Spark task; its report travels as JSON, as every other report."""
    return json.dumps(run_keyed_subtask(spec, index, []))
