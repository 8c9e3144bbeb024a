"""One source subtask of one micro-batch: read the next records of its partitions of a partitioned log.

Its positions are ``(partition, offset)`` pairs in split-distribute operator state (FLIP-8), restored from the
previous checkpoint at whatever parallelism this batch runs, so that after 2 → 1 every partition continues and after
2 → 4 no subtask idles. What it read is staged as a Parquet file under ``chk-<n>/`` for the keyed stage; its new
positions go into its operator state snapshot, which the checkpoint commits together with the keyed state — so a
batch that fails re-reads exactly the same records next time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from keygroups.checkpoint import CheckpointStorage
from keygroups.sources import PartitionedLogReader, PartitionedLogSource
from keygroups.state import OperatorStateStore, checkpoint_function, initialize_function


@dataclass(frozen=True)
class SourceTaskSpec:
    """What a source subtask needs (small, shipped to it by Spark)."""

    log_directory: str
    record_schema: pa.Schema | None
    parallelism: int
    max_records: int | None
    checkpoint_location: str
    checkpoint_id: int
    restore_from: int | str | None   # a checkpoint id, a savepoint name, or None (no state yet)
    storage_options: dict[str, Any] | None = None


def run_source_subtask(spec: SourceTaskSpec, subtask_index: int) -> dict[str, Any]:
    """Read one micro-batch of subtask ``subtask_index``'s partitions; returns its report (JSON-able)."""
    start = time.perf_counter()
    storage = CheckpointStorage(spec.checkpoint_location, storage_options=spec.storage_options)
    store = OperatorStateStore(subtask_index, spec.parallelism)
    restored_bytes = 0
    if spec.restore_from is not None:
        stats = store.restore(storage, storage.load_restore_point(spec.restore_from))
        restored_bytes = stats.bytes_read
    reader = PartitionedLogReader(PartitionedLogSource(spec.log_directory))
    initialize_function(reader, store)
    table = reader.poll_arrow(spec.max_records, schema=spec.record_schema)
    if spec.record_schema is not None and table.num_rows == 0:
        table = _empty_input(spec.record_schema)
    input_file = None
    if table.num_rows:
        input_file = storage.new_file(spec.checkpoint_id, f"input-{subtask_index}") + ".parquet"
        with storage.open_write(input_file) as f:
            pq.write_table(table, f)
    handle = checkpoint_function(reader, store, spec.checkpoint_id, int(time.time() * 1000), storage).result()
    return {
        "subtask": subtask_index,
        "operator_handle": handle.to_json(),
        "input_file": input_file,
        "records": table.num_rows,
        "partitions": reader.partitions,
        "positions": {str(p): o for p, o in reader.positions.items()},
        "restored_bytes": restored_bytes,
        "seconds": time.perf_counter() - start,
    }


def _empty_input(schema: pa.Schema) -> pa.Table:
    return pa.schema(list(schema) + [pa.field("_partition", pa.int32()), pa.field("_offset", pa.int64())]).empty_table()


def staged_schema(record_schema: pa.Schema) -> pa.Schema:
    """The schema of the staged input: the records' columns plus their log position."""
    return _empty_input(record_schema).schema
