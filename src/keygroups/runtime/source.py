"""One source subtask of one micro-batch: read the next records of its splits of a replayable source.

A source is anything with the small :class:`Source` protocol: the file log
(:class:`~keygroups.sources.PartitionedLogSource`, the embedded default) and Kafka
(:class:`~keygroups.sources.KafkaSource`). Its positions — ``(partition, offset)`` of a log, ``(topic, partition,
offset)`` of Kafka — are split-distribute operator state (FLIP-8), restored from the previous checkpoint at whatever
parallelism this batch runs, so that after 2 → 1 every partition continues and after 2 → 4 no subtask idles. What a
subtask read is staged as a Parquet file under ``chk-<n>/`` for the keyed stage; its new positions go into its
operator state snapshot, which the checkpoint commits together with the keyed state — so a batch that fails
re-reads exactly the same records next time.

The batch, as the driver runs it: ``source.prepare(previous)`` once on the driver (Kafka lists its topics and
partitions there, so that every subtask sees the same ones), the prepared source shipped to every subtask in its
:class:`SourceTaskSpec`, :func:`run_source_subtask` in each, and ``source.notify_checkpoint_complete(metadata)``
once the checkpoint is committed (Kafka reports the positions to its consumer group then, for monitoring).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import pyarrow as pa
import pyarrow.parquet as pq

from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.runtime.report import SourceReport
from keygroups.sources import PartitionedLogSource, staged_log_schema
from keygroups.state import OperatorStateStore, checkpoint_function, initialize_function

__all__ = ["Source", "SourceReader", "SourceTaskSpec", "run_source_subtask", "as_source", "prepared_source",
           "staged_schema"]


@runtime_checkable
class SourceReader(Protocol):
    """What a source subtask drives: a ``CheckpointedFunction`` (its positions in operator state) that reads."""

    def initialize_state(self, context: Any) -> None: ...

    def snapshot_state(self, context: Any) -> None: ...

    def poll_arrow(self, max_records: int | None = None, schema: pa.Schema | None = None) -> pa.Table:
        """Up to ``max_records`` records (None: all there are now) as one table of the staged schema, the
        positions advanced past them."""
        ...

    def report(self) -> dict[str, Any]:
        """This subtask's ``partitions`` and ``positions`` after the poll, and what it noted (``records_skipped``
        and :data:`~keygroups.runtime.report.SOURCE_NOTES`), in the JSON form a checkpoint stores; read into a
        :class:`~keygroups.runtime.report.SourceReport` by :func:`run_source_subtask`."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class Source(Protocol):
    """A replayable, partitioned input whose read positions live in the job's operator state."""

    def prepare(self, previous: CheckpointMetadata | None) -> Source:
        """On the driver, once per batch, before any subtask runs: the source to ship to the subtasks (what they
        must all see alike, e.g. Kafka's topics and partitions now). ``previous`` is the batch's restore point."""
        ...

    def create_reader(self) -> SourceReader:
        """In a source subtask: the reader of that subtask's splits."""
        ...

    def staged_schema(self, record_schema: pa.Schema | None) -> pa.Schema:
        """The staged input's schema: the records' columns and their position columns."""
        ...

    def notify_checkpoint_complete(self, metadata: CheckpointMetadata) -> None:
        """On the driver, once the batch's checkpoint is committed."""
        ...


def as_source(source: Source | str | os.PathLike[str]) -> Source:
    """``source`` itself, or the partitioned log in directory ``source``."""
    if isinstance(source, (str, os.PathLike)):
        return PartitionedLogSource(source)
    if not isinstance(source, Source):
        raise TypeError(f"a source is a partitioned-log directory, a keygroups.sources.PartitionedLogSource or a "
                        f"keygroups.sources.KafkaSource, got {type(source).__name__}: {source!r:.200}")
    return source


def prepared_source(source: Source | str | os.PathLike[str], previous: CheckpointMetadata | None) -> Source:
    """:func:`as_source`, prepared on the driver for one batch restoring from ``previous``."""
    return as_source(source).prepare(previous)


@dataclass(frozen=True)
class SourceTaskSpec:
    """What a source subtask needs (small, shipped to it by Spark): the prepared source and where the batch's
    checkpoint goes."""

    source: Source
    record_schema: pa.Schema | None
    parallelism: int
    max_records: int | None
    checkpoint_location: str
    checkpoint_id: int
    restore_from: int | str | None   # a checkpoint id, a savepoint name, or None (no state yet)
    storage_options: dict[str, Any] | None = None

    @property
    def staged_schema(self) -> pa.Schema:
        """The schema of what the subtasks stage: the records' columns and their position columns."""
        return self.source.staged_schema(self.record_schema)


def run_source_subtask(spec: SourceTaskSpec, subtask_index: int) -> SourceReport:
    """Read one micro-batch of subtask ``subtask_index``'s splits; returns its report (``to_json`` carries it from a
    Spark task to the driver)."""
    start = time.perf_counter()
    storage = CheckpointStorage(spec.checkpoint_location, storage_options=spec.storage_options)
    store = OperatorStateStore(subtask_index, spec.parallelism)
    restored_bytes = 0
    if spec.restore_from is not None:
        stats = store.restore(storage, storage.load_restore_point(spec.restore_from))
        restored_bytes = stats.bytes_read
    reader = spec.source.create_reader()
    try:
        initialize_function(reader, store)
        table = reader.poll_arrow(spec.max_records, spec.record_schema)
        # the reader describes its splits in JSON (the SourceReader protocol); typed here, once
        described = SourceReport.from_json({**reader.report(), "subtask": subtask_index, "records": table.num_rows})
    finally:
        reader.close()
    if spec.record_schema is not None and table.num_rows == 0:
        table = spec.staged_schema.empty_table()
    input_file = None
    if table.num_rows:
        input_file = storage.new_file(spec.checkpoint_id, f"input-{subtask_index}") + ".parquet"
        with storage.open_write(input_file) as f:
            pq.write_table(table, f)
    handle = checkpoint_function(reader, store, spec.checkpoint_id, int(time.time() * 1000), storage).result()
    return dataclasses.replace(described, operator_handle=handle, input_file=input_file,
                               restored_bytes=restored_bytes, seconds=time.perf_counter() - start)


def staged_schema(record_schema: pa.Schema) -> pa.Schema:
    """The schema of a partitioned log's staged input: the records' columns plus their log position."""
    return staged_log_schema(record_schema)  # type: ignore[no-any-return]
