"""The batch spine's executor on Spark (:class:`SparkExecutor`): a batch's subtasks as Spark tasks.

The input is checked against the job (on the driver, before any Spark job), read once where the driver needs a figure of
it first (persisted while one job counts it and finds its largest event time), placed so that each Spark partition holds
exactly one subtask's key groups (``repartitionById`` with the key group computed inside the shuffle; which subtask each
partition carries: :func:`subtask_order`), and run by one ``mapInArrow`` job whose tasks return their reports as JSON;
subtasks Spark skipped (no records) run as tasks of their own. What does not change while the input's schema and the
ranges stay the same (the input checks, the Arrow schema, the placement's Catalyst expressions, the digest column) is
built once per job (:class:`SparkPlanCache`); on a classic session the keyed stage's plan above the input is analysed
once too and put on each batch's input (:class:`KeyedStagePlan`), and over a narrow input (a scan, a micro-batch's rows,
projections and filters) the stage runs in a clone of the user's session without adaptive execution, as one Spark job
planned once (:func:`keyed_stage_session`). Both cut the driver's fixed cost of a small batch; the user's session is
never changed.

The output and staged input files are read by :func:`read_checkpoint_files`: with Spark's own Parquet reader where
Hadoop reaches the checkpoint location as the tasks did (a local path, ``hdfs://``), and otherwise by Spark tasks
that read each file through the checkpoint storage, with the job's ``storage_options`` (``s3://`` without Hadoop's S3A
connector, or with an endpoint and credentials Hadoop is not configured with).
"""

from __future__ import annotations

import datetime
import json
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from pyspark import StorageLevel, TaskContext
from pyspark.serializers import BatchedSerializer, CPickleSerializer
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
from pyspark.sql.types import (
    ArrayType,
    IntegerType,
    IntegralType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)
from pyspark.traceback_utils import SCCallSiteSync
from pyspark.util import local_connect_and_auth

from keygroups._parquet import arrow_owned
from keygroups._hashing import KeyType
from keygroups.checkpoint import CheckpointStorage
from keygroups.runtime.backends import key_type_for_schema
from keygroups.runtime.batch import InputFigures, JobOptions
from keygroups.runtime.driver import BatchPlan
from keygroups.runtime.report import InputDigest, SourceReport, SubtaskReport
from keygroups.runtime.source import SourceTaskSpec, run_source_subtask
from keygroups.runtime.spec import KeyedTaskSpec
from keygroups.runtime.subtask import run_keyed_subtask
from keygroups.runtime.subtask_input import unused_name
from keygroups.spark._worker_gc import settle_worker_heap
from keygroups.spark._worker_socket import acknowledged
from keygroups.spark.partitioner import _key_group_placement, _partition_by_key_group

_log = logging.getLogger(__name__)

# Spark types, not DDL strings: a DDL string costs mapInArrow a round trip to the JVM's parser on every call.
_REPORT_SCHEMA = StructType([StructField("subtask", IntegerType()), StructField("report", StringType())])
_REPORT_ARROW = pa.schema([("subtask", pa.int32()), ("report", pa.string())])
_TASK_SCHEMA = StructType([StructField("index", LongType()), StructField("report", StringType())])
_TASK_ARROW = pa.schema([("index", pa.int64()), ("report", pa.string())])
#: The per-record input digest column, added before the shuffle and removed before the function sees the records.
_DIGEST = "__keygroups_input_digest"
_U64 = 1 << 64


def quoted(name: str) -> Column:
    return F.col("`" + name.replace("`", "``") + "`")


def _record_digest(df: DataFrame) -> Column:
    """Spark's xxhash64 of a record over all its columns (a map by its sorted entries: Spark refuses to hash maps)."""
    columns = [F.array_sort(F.map_entries(quoted(f.name))) if isinstance(f.dataType, MapType) else quoted(f.name)
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


def input_arrow_schema(df: DataFrame) -> pa.Schema:
    """The Arrow schema ``mapInArrow`` hands a DataFrame's rows over in: Spark timestamps carry the session's time
    zone, as Spark sends them."""
    return to_arrow_schema(df.schema, timezone=df.sparkSession.conf.get("spark.sql.session.timeZone"))


# ---- reading the files a batch wrote -------------------------------------------------------------------------------

# Schemes whose files Spark's own Parquet reader reaches exactly as the tasks wrote them, with nothing from the job's
# storage_options: local paths (CheckpointStorage makes them absolute, without a scheme) and HDFS, whose address is
# all in the URL. Any other URL is read through the checkpoint storage: the tasks wrote through it, so it reaches
# the files, where Hadoop may lack the connector (s3:// without S3A) or the endpoint and credentials.
_SPARK_READER_SCHEMES = frozenset({"file", "hdfs", "viewfs"})

FileReader = Literal["auto", "spark", "storage"]


def _scheme(location: str) -> str:
    return location.split("://", 1)[0].lower() if "://" in location else "file"


_GLOB_CHARACTERS = re.compile(r"([\\\[\]{}*?])")


def _literal_glob(path: str) -> str:
    """``path`` as a Hadoop glob pattern that matches only itself: Spark's file reader expands every path it is given
    as a glob, so a location holding ``[``, ``{``, ``*``, ``?`` or ``\\`` is escaped (``[0]`` would otherwise match
    ``0``, and ``{`` fail to parse). (Spark's switch that turns the expansion off, an internal option, reads each
    file of such a location once per file given, in Spark 4.1.)"""
    return _GLOB_CHARACTERS.sub(r"\\\1", path)


def _read_parquet_file(storage: CheckpointStorage, relpath: str, schema: pa.Schema) -> Any:
    """The record batches of one Parquet file under ``storage``, as ``schema`` (timestamps as the task wrote them,
    UTC instants)."""
    # one whole-object GET on object stores (no listing, no HEAD), copied into memory Arrow owns (keygroups._parquet)
    buffer = arrow_owned(storage.open_buffer(relpath))
    for batch in pq.ParquetFile(pa.BufferReader(buffer)).iter_batches():
        yield batch if batch.schema.equals(schema) else batch.cast(schema)


#: Files that hold at most this many records together are read as one partition, so that a sink's aggregate
#: over them (``output.count()``) runs as one Spark job without a shuffle (Spark would give each small file a
#: partition of its own, and an aggregate over more than one partition costs a second job). A Spark job costs
#: about 0.1 s; one task reads this many records in a few tens of milliseconds.
ONE_PARTITION_RECORDS = 100_000


def read_checkpoint_files(spark: SparkSession, storage: CheckpointStorage, files: Sequence[str], schema: pa.Schema,
                          *, reader: FileReader = "auto", records: int | None = None) -> DataFrame:
    """The Parquet files ``files`` (relative to ``storage``'s location: a batch's output or staged input) as one
    lazy DataFrame of ``schema``; evaluating it again reads the files again. ``records``, when known, is how many
    records the files hold: up to :data:`ONE_PARTITION_RECORDS` they are read as one partition.

    ``reader="spark"`` is Spark's own Parquet reader over ``<location>/<file>`` (Hadoop must reach the location;
    the names are taken literally, never as glob patterns); ``"storage"`` reads in Spark tasks, one per file,
    through ``storage`` with its ``storage_options``, as the tasks that wrote them did; ``"auto"`` takes Spark's
    reader for local paths and ``hdfs://`` (faster: no Python worker, no Arrow hand-over) and the storage for every
    other URL (``s3://``, ``gs://``, ...)."""
    spark_schema = from_arrow_schema(schema)
    if not files:
        return spark.createDataFrame([], spark_schema)
    if reader == "auto":
        reader = "spark" if _scheme(storage.location) in _SPARK_READER_SCHEMES else "storage"
    one_partition = records is not None and records <= ONE_PARTITION_RECORDS and len(files) > 1
    if reader == "spark":
        base = storage.location.rstrip("/")
        df = spark.read.schema(spark_schema).parquet(*[_literal_glob(f"{base}/{f}") for f in files])
        return df.coalesce(1) if one_partition else df
    if reader != "storage":
        raise ValueError(f"reader must be 'auto', 'spark' or 'storage', got {reader!r}")

    files = list(files)

    def read(batches: Any) -> Any:
        for batch in batches:
            for index in batch.column(0).to_pylist():
                yield from _read_parquet_file(storage, files[index], schema)

    ids = spark.range(0, len(files), 1, 1) if one_partition else _one_task_each(spark, len(files))
    return ids.mapInArrow(read, spark_schema)


def _one_task_each(spark: SparkSession, n: int) -> DataFrame:
    """The ids ``0..n-1`` in ``n`` partitions, one id each: a DataFrame whose ``mapInArrow`` runs one Spark task per
    item. Built from ``spark.range``, so it works on classic sessions and over Spark Connect alike (Connect has no
    SparkContext to ``parallelize`` with)."""
    return spark.range(0, n, 1, n)


def start_worker_task(batches: Iterable[Any]) -> Iterator[Any]:
    """What each keygroups task does first in its Spark Python worker, with its input: keep the worker's collector
    off its long-lived objects (:mod:`keygroups.spark._worker_gc`); the input, its arrival acknowledged at once so
    that none of it is held back by TCP's delayed acknowledgement (:mod:`keygroups.spark._worker_socket`)."""
    settle_worker_heap()
    return acknowledged(batches)


def run_tasks(spark: SparkSession, n: int, task: Callable[[int], str]) -> list[str]:
    """``task(i)`` for every ``i`` in ``0..n-1``, each in its own Spark task, in the order of ``i``; a task returns
    a string (a JSON report)."""
    def run(batches: Any) -> Any:
        for batch in start_worker_task(batches):
            for index in batch.column(0).to_pylist():
                yield pa.RecordBatch.from_pylist([{"index": index, "report": task(index)}], schema=_TASK_ARROW)

    rows = _one_task_each(spark, n).mapInArrow(run, _TASK_SCHEMA).collect()
    return [r["report"] for r in sorted(rows, key=lambda r: r["index"])]


# ---- event time ----------------------------------------------------------------------------------------------------

def event_time_column(df: DataFrame, column: str) -> Column:
    """The aggregate-ready form of the event-time column: epoch microseconds of a timestamp, the raw value of a
    TIMESTAMP_NTZ (converted on the driver) or of an integer (epoch ms)."""
    kind = df.schema[column].dataType
    c = quoted(column)
    if isinstance(kind, TimestampType):
        return F.unix_micros(c)
    if isinstance(kind, (TimestampNTZType, IntegralType)):
        return c
    raise TypeError(f"timestamp_column {column!r} is {kind.simpleString()}; allowed: a timestamp, or an integral "
                    "column of epoch milliseconds")


def _event_time_millis(df: DataFrame, column: str, value: Any) -> int | None:
    """The maximum :func:`event_time_column` found, as epoch ms (None when the column held no value)."""
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
        aggregates.append(F.max(event_time_column(df, column)))
    row = df.agg(*aggregates).collect()[0]
    return int(row[0]), (_event_time_millis(df, column, row[1]) if column is not None else None)


def max_event_time(df: DataFrame, column: str) -> int | None:
    """The largest event time of ``df``'s ``column`` in epoch ms, as the subtasks read it from Arrow (a timestamp
    with a time zone: its instant; without one (TIMESTAMP_NTZ): its wall-clock time taken as UTC; an integer: its
    value); None when the column holds no value. One Spark aggregation over the batch's input."""
    if column not in df.columns:
        raise ValueError(f"timestamp_column {column!r} is not in the input; its columns are {df.columns}")
    row = df.agg(F.max(event_time_column(df, column))).first()
    return None if row is None else _event_time_millis(df, column, row[0])


# ---- which subtask each partition carries ---------------------------------------------------------------------------

def subtask_order(parallelism: int, slots: int | None) -> tuple[int, ...]:
    """The subtask each Spark partition of the keyed stage carries (partition *j* runs subtask ``order[j]``): the
    subtasks split into ``slots`` contiguous runs of equal length (within one), taken in turn, one from each run.

    Why: Spark offers a stage's tasks in partition order, ``slots`` at a time, and a subtask's warm heap state lives
    in the Python worker that ran it (a task elsewhere forwards its subtask there and waits:
    :mod:`keygroups.runtime.warm_exchange`). After a rescale up, contiguous subtasks hold ranges that one worker
    held (2 -> 4: subtasks 0 and 1 were subtask 0's range), so in partition order the tasks that run together ran
    in one worker, one after the other, while the other idled. Spreading each wave of ``slots`` tasks over the key
    range sends them to different workers (p=4 on 2 slots: partitions 0, 1, 2, 3 carry subtasks 0, 2, 1, 3).
    With ``parallelism <= slots`` (every task runs at once), one slot, or ``slots`` unknown (None): the identity."""
    if slots is None or slots < 2 or parallelism <= slots:
        return tuple(range(parallelism))
    runs = [range(parallelism * k // slots, parallelism * (k + 1) // slots) for k in range(slots)]
    return tuple(run[i] for i in range(max(map(len, runs))) for run in runs if i < len(run))


def inverse_order(order: Sequence[int]) -> tuple[int, ...]:
    """The partition that carries each subtask, for a :func:`subtask_order` (its inverse permutation)."""
    partitions = [0] * len(order)
    for partition, subtask in enumerate(order):
        partitions[subtask] = partition
    return tuple(partitions)


def task_slots(spark: SparkSession) -> int | None:
    """How many tasks Spark runs at once on the cluster's executors (of the default resource profile), or None
    where it cannot say (Spark Connect, no executor yet, a Spark whose classes differ)."""
    context = getattr(spark, "_sc", None)   # classic sessions only
    if context is None:
        return None
    from py4j.protocol import Py4JError  # type: ignore[import-untyped]

    try:
        sc = context._jsc.sc()
        slots = int(sc.maxNumConcurrentTasks(sc.resourceProfileManager().defaultResourceProfile()))
    except (Py4JError, AttributeError, TypeError, ValueError):
        return None
    return slots if slots > 0 else None


# ---- what stays the same from batch to batch -----------------------------------------------------------------------

@dataclass(frozen=True)
class _CheckedInput:
    """The input checks' result for one schema: the Arrow schema the tasks get, the key type, and what the
    placement needs (the digest column's name, the names the columns cross ``mapInArrow`` under)."""

    arrow: pa.Schema
    key_type: KeyType
    digest_column: str
    names: tuple[str, ...]
    plain: tuple[str, ...]


class SparkPlanCache:
    """What a job builds once and reuses while its input's schema (and, for the placement, the ranges) stay the
    same: the input checks and Arrow schema, the digest and placement expressions; and the session the keyed stage
    runs in while the input session's configuration stays the same (:func:`keyed_stage_session`)."""

    def __init__(self) -> None:
        self.input: tuple[str, str, _CheckedInput] | None = None
        self.placements: dict[tuple[Any, ...], Callable[[DataFrame], DataFrame] | None] = {}
        self.digest: tuple[str, tuple[Column, Column]] | None = None
        self.stage_session: tuple[str, Any] | None = None
        self.session_conf: tuple[Any, Any] | None = None   # (the user's JVM session, its SQLConf)
        self.stages: dict[tuple[Any, ...], KeyedStagePlan | None] = {}
        #: Stage plans being built ahead (:meth:`SparkExecutor.prepare_ahead`), each set once it is built.
        self.building: dict[tuple[Any, ...], threading.Event] = {}
        self.lock = threading.Lock()   # the plans' dicts change in the plan-ahead thread too
        #: How many tasks the cluster runs at once (:func:`task_slots`), asked once per job (None: not yet known).
        self.slots: int | None = None

    def __getstate__(self) -> dict[str, Any]:
        # a job is pickled with its foreachBatch function over Spark Connect: what a thread holds stays here
        state = dict(self.__dict__)
        state["building"], state["lock"] = {}, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.lock = threading.Lock()


# ---- the keyed stage's session -------------------------------------------------------------------------------------

#: Logical operators that read or transform rows where they are (no exchange, no join, no aggregate): over an input
#: made of these only, the keyed stage's query has one shuffle (the placement's), and adaptive query execution has
#: nothing to adapt, only its cost (it plans the query in two Spark jobs and re-plans it between them).
_NARROW_OPERATORS = frozenset({
    "Project", "Filter", "Relation", "RelationV2", "LocalRelation", "Range", "LogicalRDD", "SubqueryAlias", "View",
    "MapInArrow", "MapInPandas"})
_AQE = "spark.sql.adaptive.enabled"


def _operators(tree: str) -> set[str]:
    """The operator names of a logical plan's ``treeString`` (one per line, subquery plans included)."""
    names = set()
    for line in tree.splitlines():
        node = line.lstrip(" :+-")
        if node:
            names.add(re.split(r"[ \[(]", node, maxsplit=1)[0])
    return names


def keyed_stage_session(df: DataFrame, cache: SparkPlanCache, logical_plan: Any = None) -> Any:
    """The JVM session the keyed stage's query over ``df`` runs in, or None for ``df``'s own (``logical_plan``:
    ``df``'s, when the caller has it).

    Over an input of narrow operators only (:data:`_NARROW_OPERATORS`: a scan, a streaming micro-batch's rows,
    projections and filters), the keyed stage runs in a clone of ``df``'s session whose only difference is
    adaptive query execution switched off: the query then runs as one Spark job (the shuffle's map stage and the
    ``mapInArrow`` stage) and is planned once, which saves a small batch about a third of its driver time outside
    Spark's jobs. The placement is the same (``repartitionById`` to exactly ``parallelism`` partitions, which
    adaptive execution never coalesces). The user's session is never changed, not even for a moment: the clone is
    a session of its own (``SparkSession.cloneSession``: the same SparkContext, cache and catalog, a copy of the
    configuration), made again whenever the user's session configuration changes (its time zone, Arrow batch
    size, ...), so that the stage sees the user's settings. Any other input (a join, an aggregate, a window: where
    adaptive execution may help the user's part of the plan), a session with adaptive execution already off, a
    session without a JVM (Spark Connect) or a Spark whose classes differ: ``df``'s own session, as before.

    The stage's Spark job runs on the same SparkContext and thread, so it carries the thread's job group, job
    tags and description (a streaming query's stop cancels it as before); it does not carry tags added to the
    user's session object itself (``SparkSession.addTag``), so ``spark.interruptTag`` / ``interruptAll`` on the
    user's session do not reach it."""
    jsession = getattr(df.sparkSession, "_jsparkSession", None)   # classic sessions only
    if jsession is None:
        return None
    from py4j.protocol import Py4JError  # type: ignore[import-untyped]

    try:
        plan = logical_plan if logical_plan is not None else df._jdf.logicalPlan()
        if not _operators(plan.treeString()) <= _NARROW_OPERATORS:
            return None
        if cache.session_conf is None or cache.session_conf[0] is not jsession:
            cache.session_conf = (jsession, jsession.sessionState().conf())   # the session's own: one object
        conf = cache.session_conf[1]
        settings = conf.getAllConfs().toString()
        if cache.stage_session is not None and cache.stage_session[0] == settings:
            return cache.stage_session[1]
        stage = None
        if conf.adaptiveExecutionEnabled():
            stage = jsession.cloneSession()
            stage.sessionState().conf().setConfString(_AQE, "false")
    except (Py4JError, AttributeError, TypeError):   # a Spark whose classes differ: run as before
        return None
    cache.stage_session = (settings, stage)
    return stage


class KeyedStagePlan:
    """The keyed stage's plan above its input (the digest column, the placement by key group, the renames for
    ``mapInArrow``, and the ``mapInArrow`` of the subtasks), analysed once per input schema and ranges, and put on
    each batch's input, with each batch's subtask function, in a few JVM calls.

    Building the stage with DataFrame methods costs the driver the analysis of the placement's key-group expression
    and of the digest (Catalyst's resolution and type coercion over a few hundred expression nodes) and some forty
    py4j round trips of PySpark's ``mapInArrow`` (its column lookups, the Python function's Java objects), on every
    batch, and all of it is the same every batch but for the ids of the input's columns and the function's pickled
    bytes. So the input is first projected onto columns of fixed ids (one ``Project`` of ``name AS name`` aliases
    whose ids are made once), the stage is analysed once above that projection and its constants folded once, and
    each batch rebuilds the same nodes right on the batch's input, their references to the aliases' attributes
    rewritten to the input's own, marked analysed: Spark's analyser returns such a plan as it is, and the optimizer
    finds nothing of ours to change, so the physical plan is the one DataFrame methods give, without the analysis
    and with one optimizer pass (:meth:`_resolved_rooting`; where this Spark lacks a call it takes, each batch's
    nodes go over ``Project(aliases, input)`` and are analysed and optimized as before). The ``mapInArrow`` node
    is copied around a Python function made of this batch's pickled function and the first one's environment
    (exactly what PySpark's ``mapInArrow`` would send: ``(function, return type)`` pickled by its serializer).

    Built only on a classic session (it needs the JVM's Catalyst classes): :meth:`of` returns None where it cannot
    be, and the caller builds the stage with DataFrame methods instead. A batch whose function cannot be swapped
    (pickled above Spark's broadcast threshold, or holding broadcast variables) gets the stage without the
    ``mapInArrow`` (:meth:`on` says so), and the caller adds it with PySpark's own method."""

    #: At most this many nodes above the aliases (the digest, the placement, the renames): a guard, not a limit.
    _MAX_NODES = 8

    def __init__(self, jvm: Any, aliases: Any) -> None:
        self._aliases = aliases   # Seq[Alias(UnresolvedAttribute(name), name, fixed id)]
        self._nodes: list[Any] = []   # the stage's analysed unary nodes above the aliases, bottom first
        self._map: _MapInArrowCopier | None = None   # the mapInArrow on top, if it can be copied
        # the classes and static methods, looked up once (each name py4j looks up is a round trip to the JVM)
        self._project = jvm.org.apache.spark.sql.catalyst.plans.logical.Project
        self._of_rows = jvm.org.apache.spark.sql.classic.Dataset.ofRows
        # Scala's empty List: ``nil.$colon$colon(x)`` is List(x), in one round trip where toSeq([x]) takes three
        self._nil = getattr(getattr(jvm.scala.collection.immutable, "Nil$"), "MODULE$")
        # re-rooting by attribute rewrite (see _rooted): the aliases' attributes, and AttributeMap's factory
        self._fixed: Any = None
        self._attribute_map: Any = None

    @classmethod
    def of(cls, df: DataFrame, jsession: Any, stage: Callable[[DataFrame], DataFrame],
           task: Callable[[Any], Any] | None = None, schema: StructType | None = None) -> KeyedStagePlan | None:
        """The plan of ``stage`` (DataFrame methods, applied to a DataFrame of ``df``'s columns), followed by
        ``mapInArrow(task, schema)`` when a ``task`` is given; or None."""
        from py4j.protocol import Py4JError  # type: ignore[import-untyped]

        jvm = df.sparkSession._jvm   # type: ignore[union-attr]
        if jvm is None:
            return None
        try:
            expressions = jvm.org.apache.spark.sql.catalyst.expressions
            unresolved = jvm.org.apache.spark.sql.catalyst.analysis.UnresolvedAttribute
            nil, none = _scala_seq(jvm, []), jvm.scala.Option.empty()
            aliases = _scala_seq(jvm, [expressions.Alias(unresolved.quoted(name), name,
                                                         expressions.NamedExpression.newExprId(), nil, none, nil)
                                       for name in df.columns])
            plan = cls(jvm, aliases)
            leaf = plan._rooted(df, jsession, None)[0]
            leaf_plan = leaf._jdf.logicalPlan()
            staged = stage(leaf)
            node = staged._jdf.logicalPlan()
            if task is not None and schema is not None:
                try:
                    plan._map = _MapInArrowCopier.of(df.sparkSession, staged.mapInArrow(task, schema), schema)
                except (Py4JError, AttributeError, TypeError):   # PySpark's own mapInArrow on every batch
                    plan._map = None
            root, depth = node, 0
            while not node.equals(leaf_plan):
                if depth == cls._MAX_NODES or node.children().size() != 1:
                    return None
                depth += 1
                node = node.children().apply(0)
            plan._nodes = _unary_chain(_folded(jvm, root), depth)
            plan._resolved_rooting(jvm, df, jsession, leaf_plan)
        except (Py4JError, AttributeError, TypeError):   # a Spark whose classes differ: DataFrame methods instead
            return None
        return plan

    def _resolved_rooting(self, jvm: Any, df: DataFrame, jsession: Any, leaf_plan: Any) -> None:
        """Switch to re-rooting by attribute rewrite where this Spark allows it (else the aliases stay): each
        batch, the nodes' references to the aliases' attributes are rewritten to the input's own attributes
        (``QueryPlan.rewriteAttrs``), so the plan handed to Spark is resolved as it stands and is marked analysed,
        which spares Catalyst's analysis of it (Spark's ``Analyzer.executeAndCheck`` returns an analysed plan as it
        is), and the optimizer has no projection of aliases to fold away. The nodes keep the first input's
        nullability (``rewriteAttrs`` keeps the referring side's), so a plan is only ever put on inputs of the
        schema it was made for, nullability included (the caller's cache key is the schema's JSON)."""
        from py4j.protocol import Py4JError  # type: ignore[import-untyped]

        try:
            self._attribute_map = getattr(getattr(jvm.org.apache.spark.sql.catalyst.expressions, "AttributeMap$"),
                                          "MODULE$")
            self._fixed = leaf_plan.output()
            self._rooted(df, jsession, None)   # a trial: every call this Spark must answer
        except (Py4JError, AttributeError, TypeError):   # the aliases, re-analysed each batch, as before
            self._attribute_map = self._fixed = None

    def _one(self, node: Any) -> Any:
        return getattr(self._nil, "$colon$colon")(node)

    def _rooted(self, df: DataFrame, jsession: Any, task: Callable[[Any], Any] | None,
                child: Any = None) -> tuple[DataFrame, bool]:
        if child is None:
            child = df._jdf.logicalPlan()
        if self._attribute_map is None:   # over the aliases, which Catalyst resolves against the input
            attributes, node = None, self._project(self._aliases, child)
            for above in self._nodes:
                node = above.withNewChildren(self._one(node))
        else:   # right on the input, the aliases' attributes rewritten to the input's own
            attributes, node = self._attribute_map.apply(self._fixed.zip(child.output())), child
            for above in self._nodes:
                node = above.withNewChildren(self._one(node)).rewriteAttrs(attributes)
        mapped = False
        if task is not None and self._map is not None:
            copied = self._map.over(node, task)
            if copied is not None:
                node, mapped = copied if attributes is None else copied.rewriteAttrs(attributes), True
        if attributes is not None:
            node.setAnalyzed()   # resolved as it stands: Spark's analyser returns it as it is
        return DataFrame(self._of_rows(jsession, node), df.sparkSession), mapped

    def on(self, df: DataFrame, jsession: Any, task: Callable[[Any], Any] | None = None,
           logical_plan: Any = None) -> tuple[DataFrame, bool]:
        """The keyed stage over ``df`` (of the schema the plan was made for), in the JVM session ``jsession``, and
        whether it holds ``mapInArrow(task, ...)`` (False: the caller adds it); ``logical_plan``: ``df``'s, when
        the caller has it."""
        return self._rooted(df, jsession, task, logical_plan)


def _folded(jvm: Any, plan: Any) -> Any:
    """``plan`` with its constant expressions folded (Catalyst's ``ConstantFolding``, the optimizer's own rule: the
    key-group expression's literals, the null-key error's message map), so that the optimizer finds nothing to
    fold in the stage's nodes each batch and reaches its fixed point in one pass over a plain input; ``plan`` as it
    is where this Spark has no such rule."""
    from py4j.protocol import Py4JError  # type: ignore[import-untyped]

    try:
        return getattr(getattr(jvm.org.apache.spark.sql.catalyst.optimizer, "ConstantFolding$"), "MODULE$").apply(plan)
    except (Py4JError, AttributeError, TypeError):
        return plan


def _unary_chain(node: Any, depth: int) -> list[Any]:
    """The ``depth`` nodes from ``node`` down its only children, bottom first."""
    nodes = []
    for _ in range(depth):
        nodes.append(node)
        node = node.children().apply(0)
    return nodes[::-1]


class _MapInArrowCopier:
    """Copies an analysed ``MapInArrow`` node over another child with another Python function (see
    :class:`KeyedStagePlan`): a new ``SimplePythonFunction`` of the new pickled bytes and the first function's
    environment, put into copies of the node's ``PythonUDF`` and of the node (Catalyst's ``makeCopy`` of their
    constructor arguments)."""

    def __init__(self, spark: SparkSession, node: Any, udf: Any, function: Any, schema: StructType) -> None:
        from pyspark.serializers import CloudPickleSerializer

        gateway = spark.sparkContext._gateway
        jvm = spark._jvm   # type: ignore[attr-defined]
        assert jvm is not None   # a classic session (KeyedStagePlan.of checked)
        self._context = spark.sparkContext
        self._serializer = CloudPickleSerializer()
        self._schema = schema
        self._threshold = jvm.PythonUtils.getBroadcastThreshold(self._context._jsc)
        self._simple_function = jvm.org.apache.spark.api.python.SimplePythonFunction
        self._environment = (function.envVars(), function.pythonIncludes(), function.pythonExec(),
                             function.pythonVer(), function.broadcastVars(), function.accumulator())
        self._node, self._udf = node, udf
        self._node_args, self._node_slots = _constructor_arguments(gateway, node, ("functionExpr", "child"))
        self._udf_args, self._udf_slots = _constructor_arguments(gateway, udf, ("func",))
        self._set = jvm.java.lang.reflect.Array.set   # one round trip a slot (a JavaArray's own asks its length)
        self._lock = threading.Lock()   # the argument arrays are filled anew for each copy

    @classmethod
    def of(cls, spark: SparkSession, mapped: DataFrame, schema: StructType) -> _MapInArrowCopier | None:
        node = mapped._jdf.logicalPlan()
        if node.getClass().getSimpleName() != "MapInArrow":
            return None
        udf = node.functionExpr()
        if udf.getClass().getSimpleName() != "PythonUDF" or not udf.func().getClass().getSimpleName() == (
                "SimplePythonFunction") or udf.func().broadcastVars().size() != 0:
            return None
        return cls(spark, node, udf, udf.func(), schema)

    def over(self, child: Any, task: Callable[[Any], Any]) -> Any:
        """The ``MapInArrow`` node over ``child`` running ``task``; None where PySpark would broadcast the function
        or send broadcast variables with it (its own ``mapInArrow`` handles those)."""
        context = self._context
        pickled = self._serializer.dumps((task, self._schema))   # what PySpark's mapInArrow pickles
        registry = context._pickled_broadcast_vars   # a thread-local registry: iterable, without a length
        if len(pickled) > self._threshold or next(iter(registry), None) is not None:
            registry.clear()
            return None
        function = self._simple_function(bytearray(pickled), *self._environment)
        with self._lock:
            self._set(self._udf_args, self._udf_slots[0], function)
            udf = self._udf.makeCopy(self._udf_args)
            self._set(self._node_args, self._node_slots[0], udf)
            self._set(self._node_args, self._node_slots[1], child)
            return self._node.makeCopy(self._node_args)


def _constructor_arguments(gateway: Any, node: Any, names: tuple[str, ...]) -> tuple[Any, list[int]]:
    """A Catalyst node's constructor arguments (a Java ``Object[]`` to pass to ``makeCopy``) and the positions
    of the fields ``names`` among them."""
    arity = node.productArity()
    fields = [node.productElementName(i) for i in range(arity)]
    if any(name not in fields for name in names):
        raise TypeError(f"{node.getClass().getSimpleName()} has no field among {names}: {fields}")
    arguments = gateway.new_array(gateway.jvm.java.lang.Object, arity)
    for i in range(arity):
        arguments[i] = node.productElement(i)
    return arguments, [fields.index(name) for name in names]


def _scala_seq(jvm: Any, items: list[Any]) -> Any:
    return jvm.org.apache.spark.api.python.PythonUtils.toSeq(items)


def _logical_plan(df: DataFrame) -> Any:
    """``df``'s logical plan (a JVM object) on a classic session; None over Spark Connect or where it cannot be
    had (its users then ask for it themselves, and handle what they get)."""
    if getattr(df.sparkSession, "_jsparkSession", None) is None:
        return None
    from py4j.protocol import Py4JError  # type: ignore[import-untyped]

    try:
        return df._jdf.logicalPlan()
    except (Py4JError, AttributeError):
        return None


def in_session(df: DataFrame, jsession: Any) -> DataFrame:
    """``df``'s analysed plan as a DataFrame of the JVM session ``jsession`` (the Python side keeps ``df``'s
    session object: nothing in PySpark's wrappers depends on which JVM session runs the query)."""
    dataset = df.sparkSession._jvm.org.apache.spark.sql.classic.Dataset   # type: ignore[union-attr]
    return DataFrame(dataset.ofRows(jsession, df._jdf.logicalPlan()), df.sparkSession)


def check_input(options: JobOptions, df: DataFrame, cache: SparkPlanCache) -> _CheckedInput:
    """Refuse, on the driver and before any Spark job, an input the job's columns do not fit: each error names
    the argument, the value and what the input has. Checked once per input schema (and session time zone)."""
    schema = df.schema
    key = schema.json()
    zone = df.sparkSession.conf.get("spark.sql.session.timeZone") or ""
    if cache.input is not None and cache.input[:2] == (key, zone):
        return cache.input[2]
    fields = {f.name: f.dataType for f in schema.fields}
    available = f"the input's columns are {list(fields)}"
    for argument, names in (("key_columns", options.key_columns), ("order_by", options.order_by)):
        for column in names:
            if column not in fields:
                raise ValueError(f"{argument}: column {column!r} is not in the input; {available}")
    arrow = to_arrow_schema(schema, timezone=zone or None)
    key_type = key_type_for_schema(arrow, options.key_columns)   # TypeError naming the column and allowed types
    for column in options.order_by:
        kind = fields[column]
        if isinstance(kind, (MapType, ArrayType, StructType)):
            raise TypeError(f"order_by: column {column!r} is {kind.simpleString()}, which has no order; allowed: "
                            "numbers, strings, binary, booleans, dates and timestamps")
    if options.timestamp_column is not None:
        if options.timestamp_column not in fields:
            raise ValueError(f"timestamp_column: column {options.timestamp_column!r} is not in the input; "
                             f"{available}")
        event_time_column(df, options.timestamp_column)   # TypeError naming the type and the allowed ones
    names = tuple(df.columns)
    # PySpark's mapInArrow refers to its input's columns by their bare names, which breaks on a name with a dot or
    # a backtick: such columns cross it under plain names, and get theirs back in the task.
    plain = tuple(unused_name(names, f"__kg_column_{i}") if "." in c or "`" in c else c for i, c in enumerate(names))
    checked = _CheckedInput(arrow, key_type, unused_name(names, _DIGEST), names, plain)
    cache.input = (key, zone, checked)
    cache.placements.clear()
    cache.stages.clear()
    cache.digest = None
    return checked


# ---- the executor --------------------------------------------------------------------------------------------------

class SparkExecutor:
    """Runs one batch's subtasks as Spark tasks (see the module docs): over ``df``, or (a source batch) over the
    records the source subtasks stage (``staged``: their schema, the source's columns and position columns).
    ``read_once=False`` reads the input once per figure instead of persisting it (the former path, for a
    benchmark's comparison). ``forward``: a heap subtask whose state another Python worker of the task's host holds
    warm runs there (``run_keyed_subtask(forward=True)``)."""

    def __init__(self, spark: SparkSession, options: JobOptions, storage: CheckpointStorage, cache: SparkPlanCache,
                 df: DataFrame | None = None, *, staged: pa.Schema | None = None, read_once: bool = True,
                 forward: bool = True) -> None:
        self._spark = spark
        self._forward = forward
        self._options = options
        self._storage = storage
        self._cache = cache
        self._df = df
        self._staged = staged
        self._read_once = read_once
        self._persisted: DataFrame | None = None
        self._checked: _CheckedInput | None = None
        self._keyed: DataFrame | None = None   # the keyed stage: the placed input, mapInArrow of the subtasks
        self._jsession: Any = None   # the JVM session the keyed stage runs in (None: not a classic session)
        self._spec: KeyedTaskSpec | None = None
        self._tag: str | None = None
        self._started = time.time()
        self._ended: float | None = None

    # ---- the batch's Spark jobs ----------------------------------------------------------------------------------

    def __enter__(self) -> SparkExecutor:
        self._started = time.time()
        context = self._context()
        if context is not None:   # tag the batch's jobs, to read their times from Spark's status store
            self._tag = f"keygroups-batch-{uuid.uuid4().hex}"
            context.addJobTag(self._tag)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._ended = time.time()
        if self._persisted is not None:
            self._persisted.unpersist()
            self._persisted = None
        context = self._context()
        if context is not None and self._tag is not None:
            context.removeJobTag(self._tag)

    def _context(self) -> Any:
        return getattr(self._spark, "_sc", None)   # classic sessions only

    @property
    def spark(self) -> SparkSession:
        return self._spark

    @property
    def job_tag(self) -> str | None:
        """The tag of this batch's Spark jobs, by which Spark's status store finds them (None: over Spark Connect,
        or before the batch started)."""
        return self._tag

    def spark_seconds(self) -> float | None:
        """The union of this batch's Spark jobs' runs, submission to completion (Spark's status store); None
        over Spark Connect."""
        context = self._context()
        if context is None or self._tag is None:
            return None
        jsc = context._jsc.sc()
        now = self._ended if self._ended is not None else time.time()
        spans = []
        for job_id in jsc.statusTracker().getJobIdsForTag(self._tag):
            data = jsc.statusStore().job(job_id)
            if not data.submissionTime().isDefined():
                continue
            start = data.submissionTime().get().getTime() / 1000
            # the store hears of a job's end through the listener bus, a moment after the driver does
            end = data.completionTime().get().getTime() / 1000 if data.completionTime().isDefined() else now
            spans.append((max(start, self._started), min(end, now)))
        return _union(spans)

    # ---- the input -----------------------------------------------------------------------------------------------

    @property
    def input_schema(self) -> pa.Schema:
        assert self._checked is not None, "key_type() checks the input first"
        return self._checked.arrow

    def key_type(self, key_columns: tuple[str, ...]) -> KeyType:
        if self._df is None:   # a source batch: its records are staged by its source subtasks
            assert self._staged is not None
            return key_type_for_schema(self._staged, key_columns)
        self._checked = check_input(self._options, self._df, self._cache)
        return self._checked.key_type

    def read_input(self, *, count: bool, timestamp_column: str | None) -> InputFigures:
        """``(records, max_event_time)``: the record count (if ``count``) and the largest event time found in one
        Spark job, over the input persisted so that the keyed stage reads the same rows again instead of the
        source (a DataFrame the caller cached stays as it is). Persisting costs one columnar copy of the batch (in
        executor memory, spilling to disk); a second read of the source costs its whole read and parse, each
        time."""
        df = self._df
        assert df is not None
        if not (count or timestamp_column is not None):
            return InputFigures()
        if not self._read_once:   # the former path, for the comparison in benchmarks/bench_runner.py
            return InputFigures(df.count() if count else None,
                                max_event_time(df, timestamp_column) if timestamp_column is not None else None)
        if not df.is_cached:
            df = self._df = self._persisted = df.persist(StorageLevel.MEMORY_AND_DISK)
        records, max_event = _count_and_max_event_time(df, timestamp_column)
        return InputFigures(records if count else None, max_event)

    def input_digest(self) -> InputDigest:
        assert self._df is not None
        return InputDigest.from_json(input_digest(self._df))

    def run_sources(self, spec: SourceTaskSpec) -> list[SourceReport]:
        reports = [SourceReport.from_json(json.loads(r)) for r in
                   run_tasks(self._spark, spec.parallelism,
                             lambda index: json.dumps(run_source_subtask(spec, index).to_json()))]
        self._df = read_checkpoint_files(self._spark, self._storage,
                                         [r.input_file for r in reports if r.input_file], spec.staged_schema)
        self._checked = check_input(self._options, self._df, self._cache)
        return reports

    # ---- the keyed stage -----------------------------------------------------------------------------------------

    def prepare(self, spec: KeyedTaskSpec, plan: BatchPlan) -> None:
        """The keyed stage's DataFrame: the input with its digest column, placed by key group (the placement's
        expressions built once per schema and ranges), its columns under names ``mapInArrow`` takes, and the
        ``mapInArrow`` of the subtasks; on a classic session from the plan analysed once (:class:`KeyedStagePlan`),
        in the session :func:`keyed_stage_session` chooses."""
        df, checked, cache = self._df, self._checked, self._cache
        assert df is not None and checked is not None
        key = self._stage_key(plan.max_parallelism, plan.parallelism, plan.boundaries)
        stage = self._stage(plan.max_parallelism, plan.parallelism, plan.boundaries)
        spec = self._spec = spec.compact()   # under the size at which Spark broadcasts the task's function
        subtask = self._subtask_function(spec)
        logical_plan = _logical_plan(df)   # asked of the JVM once for both uses below
        stage_session = keyed_stage_session(df, cache, logical_plan)
        jsession = stage_session if stage_session is not None else getattr(df.sparkSession, "_jsparkSession", None)
        keyed, mapped = None, False
        if jsession is not None:   # a classic session: the stage's plan analysed once, put on this input
            stage_plan = self._stage_plan(key, jsession, stage, subtask)
            if stage_plan is not None:
                keyed, mapped = stage_plan.on(df, jsession, subtask, logical_plan)
        if keyed is None:
            keyed = stage(df if stage_session is None else in_session(df, stage_session))
        self._keyed = keyed if mapped else keyed.mapInArrow(subtask, _REPORT_SCHEMA)
        self._jsession = jsession

    def prepare_ahead(self, ranges: Sequence[tuple[int, int, tuple[int, ...] | None]]) -> threading.Thread | None:
        """Build, in a thread of its own, the keyed stage's plans of other parallelisms (``ranges``: each
        ``(max_parallelism, parallelism, boundaries)``) over this batch's input schema, for later batches: the
        first batch at a new parallelism then finds its plan built (analysing it costs a small batch a few
        hundred milliseconds of the driver's time). Called after :meth:`prepare`, while the batch's Spark job
        runs (the driver waits on it); the thread (None: nothing to build) builds one plan at a time and never
        runs a Spark job. A later batch that needs a plan being built waits for it rather than build it twice."""
        cache, jsession, spec = self._cache, self._jsession, self._spec
        if jsession is None or spec is None or self._df is None:
            return None
        wanted = [(self._stage_key(mp, p, b), mp, p, b) for mp, p, b in ranges]
        wanted = [w for w in wanted if w[0] not in cache.stages and w[0] not in cache.building]
        if not wanted:
            return None
        for key, *_ in wanted:
            cache.building[key] = threading.Event()
        subtask = self._subtask_function(spec)

        def build() -> None:
            for key, mp, p, b in wanted:
                try:
                    self._stage_plan(key, jsession, self._stage(mp, p, b), subtask, ahead=True)
                except Exception:   # noqa: BLE001  # a batch at that parallelism builds its plan itself
                    _log.debug("keygroups: building the stage plan of parallelism %d ahead failed", p, exc_info=True)
                finally:
                    cache.building.pop(key).set()

        thread = threading.Thread(target=build, name="keygroups-plan-ahead", daemon=True)
        thread.start()
        return thread

    def _stage_key(self, max_parallelism: int, parallelism: int, boundaries: tuple[int, ...] | None) -> Any:
        cache = self._cache
        return (cache.input[0] if cache.input is not None else None, max_parallelism, parallelism, boundaries,
                self._order(parallelism))

    def _order(self, parallelism: int) -> tuple[int, ...]:
        """The subtask each partition carries at ``parallelism`` (:func:`subtask_order`); the cluster's task slots
        are asked once per job (until known), so a job's placement and its tasks always agree."""
        cache = self._cache
        if cache.slots is None:
            cache.slots = task_slots(self._spark)
        return subtask_order(parallelism, cache.slots)

    def _stage_plan(self, key: Any, jsession: Any, stage: Callable[[DataFrame], DataFrame],
                    subtask: Callable[[Any], Any], *, ahead: bool = False) -> KeyedStagePlan | None:
        """The stage plan of ``key`` (built once: a plan another thread is building is waited for)."""
        cache = self._cache
        building = cache.building.get(key)
        if building is not None and not ahead:
            building.wait()
        if key not in cache.stages:
            assert self._df is not None
            built = KeyedStagePlan.of(self._df, jsession, stage, subtask, _REPORT_SCHEMA)
            with cache.lock:
                cache.stages[key] = built
                while len(cache.stages) > 8:
                    cache.stages.pop(next(iter(cache.stages)))
        return cache.stages.get(key)

    def _stage(self, max_parallelism: int, parallelism: int,
               boundaries: tuple[int, ...] | None) -> Callable[[DataFrame], DataFrame]:
        """The keyed stage above a DataFrame of the input's columns, by DataFrame methods, for these ranges."""
        df, checked, cache = self._df, self._checked, self._cache
        assert df is not None and checked is not None
        if cache.digest is None:   # its Columns are unresolved: any DataFrame of this schema takes them
            cache.digest = (checked.digest_column, (F.col("*"), _record_digest(df).alias(checked.digest_column)))
        digest_column, with_digest = cache.digest
        key = self._stage_key(max_parallelism, parallelism, boundaries)
        partitions = inverse_order(self._order(parallelism))
        names, plain = list(checked.names), list(checked.plain)
        key_columns = self._options.key_columns

        def stage(frame: DataFrame) -> DataFrame:
            """The keyed stage above ``frame`` (the input, or a DataFrame of its columns), by DataFrame methods."""
            digested = frame.select(*with_digest)   # not withColumn: it looks the new name up among the columns
            if key not in cache.placements:
                placement = _key_group_placement(
                    digested, *key_columns, max_parallelism=max_parallelism, parallelism=parallelism,
                    key_group_boundaries=boundaries, partition_of_subtask=partitions)
                with cache.lock:
                    cache.placements[key] = placement
                    while len(cache.placements) > 8:
                        cache.placements.pop(next(iter(cache.placements)))
            place = cache.placements.get(key)
            if place is not None:
                placed = place(digested)
            else:
                placed = _partition_by_key_group(digested, *key_columns, max_parallelism=max_parallelism,
                                                 parallelism=parallelism, key_group_boundaries=boundaries,
                                                 partition_of_subtask=partitions)
            if plain != names:   # mapInArrow takes these columns under plain names
                placed = placed.select(*[quoted(c).alias(p) for c, p in zip(names, plain)], quoted(digest_column))
            return placed

        return stage

    def _subtask_function(self, spec: KeyedTaskSpec) -> Callable[[Any], Any]:
        """What each Spark task of the keyed stage runs: the subtask of ``spec`` its partition carries
        (:func:`subtask_order`), over the partition's records."""
        checked = self._checked
        assert checked is not None
        digest_column = self._cache.digest[0] if self._cache.digest is not None else checked.digest_column
        names, plain = list(checked.names), list(checked.plain)
        renamed = names if plain != names else None
        forward = self._forward
        order = self._order(spec.parallelism)

        def subtask(batches: Any) -> Any:
            batches = start_worker_task(batches)
            task = TaskContext.get()
            assert task is not None   # always set inside a task
            index = order[task.partitionId()]
            digested_batches = _DigestedBatches(batches, digest_column, renamed)
            report = run_keyed_subtask(spec, index, digested_batches, attempt=task.attemptNumber(),
                                       forward=forward).with_digest(
                InputDigest(digested_batches.records, digested_batches.total))
            yield pa.RecordBatch.from_pylist([{"subtask": index, "report": json.dumps(report.to_json())}],
                                             schema=_REPORT_ARROW)

        return subtask

    def run_keyed(self) -> list[SubtaskReport]:
        assert self._keyed is not None
        rows = collect_rows(self._keyed)
        return [SubtaskReport.from_json(json.loads(r["report"])) for r in rows]

    def run_idle(self, subtasks: Sequence[int]) -> list[SubtaskReport]:
        spec, forward = self._spec, self._forward
        assert spec is not None
        # in the keyed stage's order, for the same reason (Spark offers these tasks in order too)
        position = inverse_order(self._order(spec.parallelism))
        subtasks = sorted(subtasks, key=lambda s: position[s])
        reports = run_tasks(self._spark, len(subtasks),
                            lambda i: json.dumps(run_keyed_subtask(spec, subtasks[i], [], attempt=_attempt(),
                                                                   forward=forward)
                                                 .with_digest(InputDigest(0, 0)).to_json()))
        return [SubtaskReport.from_json(json.loads(r)) for r in reports]


#: ``java.util.Arrays.toString`` of each JVM view, looked up once (see :func:`collect_rows`).
_ARRAYS_TO_STRING: dict[int, tuple[Any, Any]] = {}


def collect_rows(df: DataFrame) -> list[Any]:
    """``df.collect()`` on a classic session in four round trips to the JVM where PySpark's takes about eight: the
    query's rows are served on a local socket, whose address comes back as a Java array that PySpark reads element
    by element (a length and an element each); here it is read as one string. The same rows, the same errors (the
    query's, raised by the first call), the same call site. Over Spark Connect, or where the array's text is not
    what this reads: PySpark's own reads."""
    jdf = getattr(df, "_jdf", None)
    jvm = getattr(df.sparkSession, "_jvm", None)
    if jdf is None or jvm is None:
        return df.collect()
    cached = _ARRAYS_TO_STRING.get(id(jvm))
    if cached is None or cached[0] is not jvm:   # looking the method up costs round trips of its own: once
        cached = _ARRAYS_TO_STRING[id(jvm)] = (jvm, jvm.java.util.Arrays.toString)
    # the call site set as PySpark sets it: without one, Spark walks the JVM thread's stack for each RDD the query
    # makes (Utils.getCallSite), which costs more than the two calls that set and clear it
    with SCCallSiteSync(df.sparkSession.sparkContext):
        info = jdf.collectToPython()
    # "[<port>, <secret>, <server>]" (or "[<socket path>, null, ...]" over a Unix domain socket)
    parts = str(cached[1](info)).strip("[]").split(", ", 2)
    where: Any
    secret: str | None
    if len(parts) >= 2 and parts[0].isdigit() and parts[1] and parts[1] != "null":
        where, secret = int(parts[0]), parts[1]
    elif len(parts) >= 2 and parts[0].startswith("/") and parts[1] == "null":
        where, secret = parts[0], None
    else:
        where, secret = info[0], info[1]
    return _served_rows(where, secret)


def _served_rows(where: Any, secret: str | None) -> list[Any]:
    """The rows the JVM serves on the local socket ``where`` (a port, or a Unix socket's path), as PySpark reads
    them."""
    sockfile, sock = local_connect_and_auth(where, secret)
    try:
        sock.settimeout(None)   # as PySpark: the rows come when the job has made them
        return list(BatchedSerializer(CPickleSerializer()).load_stream(sockfile))
    finally:
        sockfile.close()
        sock.close()


def _attempt() -> int:
    """The running Spark task's attempt number (0 outside a task)."""
    task = TaskContext.get()
    return 0 if task is None else task.attemptNumber()


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


__all__ = ["ONE_PARTITION_RECORDS", "SparkExecutor", "SparkPlanCache", "read_checkpoint_files", "input_digest",
           "max_event_time", "run_tasks", "check_input", "input_arrow_schema", "event_time_column", "subtask_order",
           "inverse_order", "task_slots"]
