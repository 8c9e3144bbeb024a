"""State as DataFrames: the ``keygroups`` Python data source (read) and :func:`write_savepoint` (write / bootstrap).

Reading, a thin adapter over :mod:`keygroups.runtime.state_reader`::

    spark.read.format("keygroups").option("state", "totals").load(checkpoint_location)

reads the latest complete checkpoint (``.option("checkpointId", 7)``: that one; ``.option("savepoint", name)``: a
savepoint in that location). Options (names are case-insensitive):

* ``state``: the state to read (required for the keyed and operator views; the error lists the states there are);
* ``view``: ``keyed`` (default: one row per key, see ``KeyedStateReader``), ``metadata`` (per key group and state:
  kind, serializers, TTL, keys, entries, bytes, chain), ``operator`` (one operator state, per subtask and mode),
  ``timers`` (every registered timer: key, key group, time domain, timestamp; Spark's ``readRegisteredTimers``,
  see ``state_reader.read_timers``; no ``state`` option) or ``metrics`` (the metrics of the last batches the job
  kept beside its checkpoints, see :mod:`keygroups.metrics`; no ``state`` option; ``checkpointId``: that batch's
  only);
* ``level`` (view ``metrics``): ``batch`` (default: a row per batch), ``subtask`` (a row per batch and subtask)
  or ``keyGroup`` (a row per batch and key group);
* ``flattenCollections``: ``true`` for one row per list element / map entry (Spark's ``flattenCollectionTypes``);
* ``keyColumns``: comma-separated names of the key column(s);
* ``partitions`` or ``partitionBytes``: how the key groups are cut into Spark partitions (default: runs of
  contiguous key groups of about 64 MiB stored each); each task reads only its key groups' chains;
* ``storageOptions``: a JSON object of fsspec options for a remote location.

Registration: the source is registered with the active session when ``keygroups.spark`` is imported, and
:func:`register` registers it with any session created later (Python data sources are registered per session, and
Spark offers no hook to register them when a session starts).

Writing: :func:`write_savepoint` builds a savepoint from a DataFrame that a ``KeyedJob`` starts from
(``restore_from_savepoint=name``). It is a function, not ``df.write.format("keygroups")``: a savepoint's rows must be
placed by key group before any task writes (a data source writer gets the DataFrame's partitions as they are, so
two tasks would write one key group), and its arguments (a serializer per state, TTL configs) are objects, not the
string options a data source writer takes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.datasource import DataSource, DataSourceReader, InputPartition
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
from pyspark.sql.types import StructType

from keygroups._ranges import KeyGroupRange
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage, KeyedStateHandle
from keygroups.errors import CheckpointNotFoundError
from keygroups.metrics import MetricsStore, metrics_table
from keygroups.metrics.model import SCHEMAS
from keygroups.runtime.state_reader import (
    METADATA_SCHEMA,
    KeyedStateReader,
    StateNotFoundError,
    key_group_partitions,
    keyed_state_metas,
    load_restore_point,
    metadata_table,
    operator_state_names,
    operator_state_schema,
    operator_state_table,
    read_timers,
    timer_schema,
)
from keygroups.runtime.state_writer import (
    StateColumn,
    commit_savepoint,
    plan_savepoint,
    write_savepoint_subtask,
)
from keygroups.spark.partitioner import partition_by_key_group

SOURCE_NAME = "keygroups"
VIEWS = ("keyed", "metadata", "operator", "timers", "metrics")
#: The options the reader knows, lower case (Spark passes option names case-insensitively).
OPTIONS = ("path", "state", "checkpointid", "savepoint", "view", "flattencollections", "keycolumns", "partitions",
           "partitionbytes", "storageoptions", "level")
#: The metrics view's batches per Spark partition (level keyGroup: a row per key group of each).
_METRICS_BATCHES_PER_PARTITION = 8
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _int_option(options: dict[str, str], name: str, display: str, minimum: int) -> int | None:
    raw = options.get(name)
    if raw is None:
        return None
    try:
        value = int(str(raw).strip())
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ValueError(f"option {display!r} must be an int >= {minimum}, got {raw!r}")
    return value


class _Request:
    """The reader's options, checked, and the restore point they name (loaded once, on the driver)."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        options = {str(k).lower(): str(v) for k, v in raw.items() if v is not None}
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ValueError(f"unknown option(s) {unknown} for format('keygroups'); allowed: path, state, "
                             f"checkpointId, savepoint, view, flattenCollections, keyColumns, partitions, "
                             f"partitionBytes, storageOptions, level")
        path = options.get("path")
        if not path:
            raise ValueError("format('keygroups') needs a path: .load(<checkpoint location>), the directory that "
                             "holds chk-<id>/ and savepoints/")
        self.view = options.get("view", "keyed").lower()
        if self.view not in VIEWS:
            raise ValueError(f"option 'view' must be one of {', '.join(VIEWS)}, got {options['view']!r}")
        flatten = options.get("flattencollections", "false").lower()
        if flatten not in _TRUE + _FALSE:
            raise ValueError(f"option 'flattenCollections' must be true or false, got "
                             f"{options['flattencollections']!r}")
        self.flatten = flatten in _TRUE
        keys = options.get("keycolumns")
        self.key_columns = [c.strip() for c in keys.split(",")] if keys else None
        if self.key_columns is not None and not all(self.key_columns):
            raise ValueError(f"option 'keyColumns' must be comma-separated column names, got {keys!r}")
        self.partitions = _int_option(options, "partitions", "partitions", 1)
        self.partition_bytes = _int_option(options, "partitionbytes", "partitionBytes", 1)
        storage_options: Any = {}
        if "storageoptions" in options:
            try:
                storage_options = json.loads(options["storageoptions"])
            except ValueError:
                storage_options = None
            if not isinstance(storage_options, dict):
                raise ValueError(f"option 'storageOptions' must be a JSON object of fsspec options, got "
                                 f"{options['storageoptions']!r}")
        checkpoint_id = _int_option(options, "checkpointid", "checkpointId", 0)
        self.state = options.get("state")
        self.storage = CheckpointStorage(path, storage_options=storage_options)
        self.metrics: MetricsStore | None = None
        if "level" in options and self.view != "metrics":
            raise ValueError("option 'level' is the metrics view's (.option('view', 'metrics')); view "
                             f"{self.view!r} has none")
        if self.view == "metrics":   # the store beside the checkpoints: no checkpoint is read
            self.level = options.get("level", "batch").lower()
            if self.level not in SCHEMAS:
                raise ValueError(f"option 'level' must be batch, subtask or keyGroup, got {options['level']!r}")
            self.metrics = MetricsStore(path, storage_options=storage_options)
            ids = self.metrics.checkpoint_ids()
            self.metric_ids = [i for i in ids if checkpoint_id is None or i == checkpoint_id]
            if checkpoint_id is not None and not self.metric_ids:
                raise CheckpointNotFoundError(
                    f"no metrics of checkpoint {checkpoint_id} in {self.metrics.url(checkpoint_id)}; the store "
                    f"keeps batches {ids[:1]}..{ids[-1:]} ({len(ids)} of them)")
            self.keyed = None
            return
        self.metadata: CheckpointMetadata = load_restore_point(self.storage, checkpoint_id=checkpoint_id,
                                                               savepoint=options.get("savepoint"))
        if self.view in ("keyed", "operator") and self.state is None:
            raise StateNotFoundError(
                f"option 'state' names the state to read (view {self.view!r}); keyed states here: "
                f"{sorted(keyed_state_metas(self.metadata)) or 'none'}, operator states: "
                f"{operator_state_names(self.metadata) or 'none'} (or read .option('view', 'metadata'))")
        self.keyed = (KeyedStateReader(self.storage, self.metadata, self.state, flatten=self.flatten,
                                       key_columns=self.key_columns)
                      if self.view == "keyed" and self.state is not None else None)

    @property
    def arrow_schema(self) -> pa.Schema:
        if self.view == "metrics":
            return SCHEMAS[self.level]
        if self.keyed is not None:
            return self.keyed.schema
        if self.view == "metadata":
            return METADATA_SCHEMA
        if self.view == "timers":
            return timer_schema(self.metadata, key_columns=self.key_columns)
        return operator_state_schema(self.metadata, self.state)   # type: ignore[arg-type]

    def key_group_partitions(self) -> list[KeyGroupRange]:
        if self.partitions is not None:
            return key_group_partitions(self.metadata, count=self.partitions)
        if self.partition_bytes is not None:
            return key_group_partitions(self.metadata, target_bytes=self.partition_bytes)
        return key_group_partitions(self.metadata)


class KeyGroupRangePartition(InputPartition):
    """One Spark partition of a keyed or metadata read: the key groups ``start``..``end``."""

    def __init__(self, start: int, end: int) -> None:
        super().__init__((start, end))
        self.start = start
        self.end = end


class _StateReader(DataSourceReader):
    def __init__(self, request: _Request, schema: StructType) -> None:
        self.request = request
        # Spark takes a batch only in the exact Arrow form of the schema's types (list items named "element",
        # microsecond timestamps in UTC): the reader's own types are cast to it.
        self.arrow_schema = to_arrow_schema(schema, timezone="UTC")

    def _cast(self, batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        target = self.arrow_schema
        for batch in batches:
            yield batch if batch.schema.equals(target) else batch.cast(target)

    def partitions(self) -> Sequence[InputPartition]:
        if self.request.view == "operator":
            return [InputPartition(0)]
        if self.request.view == "metrics":
            ids = self.request.metric_ids
            size = _METRICS_BATCHES_PER_PARTITION if self.request.level == "keygroup" else max(1, len(ids))
            return [InputPartition(ids[i:i + size]) for i in range(0, len(ids), size)] or [InputPartition([])]
        return [KeyGroupRangePartition(r.start, r.end) for r in self.request.key_group_partitions()]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return self._cast(self._batches(partition))

    def _batches(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        request = self.request
        if request.view == "metrics":
            assert request.metrics is not None
            history = []
            for cid in partition.value:
                try:
                    history.append(request.metrics.read(cid))
                except FileNotFoundError:   # pruned by the job since the listing: the next read lists again
                    continue
            yield from metrics_table(history, request.level).to_batches()
            return
        if request.view == "operator":
            assert request.state is not None   # checked with the options
            yield from operator_state_table(request.storage, request.metadata, request.state).to_batches()
            return
        assert isinstance(partition, KeyGroupRangePartition)
        groups = KeyGroupRange(partition.start, partition.end)
        if request.keyed is not None:
            yield from request.keyed.read(groups)
        elif request.view == "timers":
            yield from read_timers(request.storage, request.metadata, groups,
                                   key_columns=request.key_columns).to_batches()
        elif groups:
            yield from metadata_table(request.storage, request.metadata, groups).to_batches()


class KeyGroupsDataSource(DataSource):
    """``spark.read.format("keygroups")``: see the module docs for the options."""

    @classmethod
    def name(cls) -> str:
        return SOURCE_NAME

    def _request(self) -> _Request:
        request = getattr(self, "_checked", None)
        if request is None:
            request = self._checked = _Request(self.options)
        return request

    def schema(self) -> StructType:
        return from_arrow_schema(self._request().arrow_schema)

    def reader(self, schema: StructType) -> DataSourceReader:
        return _StateReader(self._request(), schema)


def register(spark: SparkSession | None = None) -> None:
    """Register ``format("keygroups")`` with ``spark`` (the active session by default). Importing
    ``keygroups.spark`` already registers it with the session active then; call this for sessions created later."""
    session = spark if spark is not None else SparkSession.getActiveSession()
    if session is None:
        raise RuntimeError("no active SparkSession to register format('keygroups') with: create one first, or pass "
                           "it as register(spark)")
    session.dataSource.register(KeyGroupsDataSource)


def _register_with_active_session() -> None:
    session = SparkSession.getActiveSession()
    if session is not None:
        session.dataSource.register(KeyGroupsDataSource)


# ---- writing ------------------------------------------------------------------------------------------------------

_HANDLES_SCHEMA = "subtask int, handle string"
_HANDLES_ARROW = pa.schema([("subtask", pa.int32()), ("handle", pa.string())])
_ONE_SCHEMA = "n int"
_ONE_ARROW = pa.schema([("n", pa.int32())])


def _one_row(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    for _ in batches:
        pass
    yield pa.RecordBatch.from_pylist([{"n": 1}], schema=_ONE_ARROW)


def default_parallelism(spark: SparkSession) -> int:
    """Spark's default parallelism (``SparkContext.defaultParallelism``) on either session type. A Spark Connect
    session has no SparkContext to ask: there it is the number of partitions the server splits ``spark.range`` into
    when none is given, which is that same default parallelism (``spark.default.parallelism`` if set, else the
    cluster's cores) unless ``spark.sql.leafNodeDefaultParallelism`` overrides it; one tiny task per partition
    counts them."""
    if getattr(spark, "_jvm", None) is not None:   # classic sessions only
        return int(spark.sparkContext.defaultParallelism)
    return int(spark.range(0, 1).mapInArrow(_one_row, _ONE_SCHEMA).count())


def write_savepoint(df: DataFrame, location: str, name: str, *, key_columns: Sequence[str] | str,
                    states: Mapping[str, str | StateColumn], max_parallelism: int, parallelism: int | None = None,
                    storage_options: dict[str, Any] | None = None) -> str:
    """Write the rows of ``df`` as savepoint ``name`` in checkpoint location ``location``, from Spark tasks in
    parallel, and return the savepoint's directory. Start a job from it with ``KeyedJob(..., max_parallelism=
    max_parallelism, checkpoint_location=location, restore_from_savepoint=name)`` at any parallelism.

    One row per key: ``key_columns`` form the key (as a ``KeyedJob`` keys those columns); ``states`` maps each state
    name to its column, or to a :class:`StateColumn` (kind, serializers, TTL). A null leaves the key without an
    entry in that state. ``parallelism`` (default: Spark's default parallelism, see :func:`default_parallelism`, at
    most ``max_parallelism``) is how many files, one per subtask's key groups, are written; the job may use any
    other. ValueError (before anything is written) for a bad request; DuplicateKeyError for a key in two rows
    (nothing is committed)."""
    spark = df.sparkSession
    if parallelism is None:
        parallelism = max(1, min(max_parallelism, default_parallelism(spark)))
    schema = to_arrow_schema(df.schema, timezone=spark.conf.get("spark.sql.session.timeZone"))
    plan = plan_savepoint(schema, location, name, key_columns=key_columns, states=states,
                          max_parallelism=max_parallelism, parallelism=parallelism, storage_options=storage_options)
    wanted = list(dict.fromkeys([*plan.key_columns, *(s.column for s in plan.states),
                                 *(s.ttl_column for s in plan.states if s.ttl_column is not None)]))
    placed = partition_by_key_group(df.select(*wanted), *plan.key_columns, max_parallelism=plan.max_parallelism,
                                    parallelism=plan.parallelism)

    def subtask(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        index = TaskContext.get().partitionId()  # type: ignore[union-attr]  # always set inside a task
        # the spill goes where Spark keeps its own shuffle files (SPARK_LOCAL_DIRS, set for its Python workers), not
        # to a /tmp that may be small or in memory
        local_dirs = [d for d in os.environ.get("SPARK_LOCAL_DIRS", "").split(",") if d]
        handle = write_savepoint_subtask(plan, index, batches, spill_dir=local_dirs[0] if local_dirs else None)
        text = json.dumps(handle.to_json()) if handle is not None else ""
        yield pa.RecordBatch.from_pylist([{"subtask": index, "handle": text}], schema=_HANDLES_ARROW)

    rows = placed.mapInArrow(subtask, _HANDLES_SCHEMA).collect()
    handles = [KeyedStateHandle.from_json(json.loads(r["handle"])) for r in rows if r["handle"]]
    commit_savepoint(plan, handles)
    return plan.storage.url(plan.directory)


__all__ = ["KeyGroupsDataSource", "KeyGroupRangePartition", "default_parallelism", "register", "write_savepoint",
           "SOURCE_NAME", "VIEWS"]
