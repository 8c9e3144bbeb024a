"""The demo's shop job run without Spark, through the same driver and subtasks the Spark runner uses: shared by
test_runtime.py, test_spark_job.py and the fault campaign (fault_campaign.py), so the batch is written once.

A batch: the source subtasks read the next records of the log and stage them, the records are placed by key group
(as Spark's shuffle places them), the keyed subtasks run (in this process, or through ``run_subtask``: a worker
process in the fault campaign), and the driver commits."""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

import keygroups as kg
from keygroups.checkpoint import CheckpointMetadata, CheckpointStorage
from keygroups.cli import shop
from keygroups.runtime import WatermarkStrategy, begin_batch, commit_batch
from keygroups.runtime.backends import create_backend
from keygroups.runtime.report import SourceReport, SubtaskReport
from keygroups.runtime.source import Source, run_source_subtask
from keygroups.runtime.subtask import run_keyed_subtask

MAX_PARALLELISM = 64
JOB_NAME = "carts"


def no_fault(point: str) -> None:
    """The default fault hook of :func:`run_batch`: nothing happens at any point."""


def run_batch(location: str, log_dir: str | Source, function: Any, parallelism: int, max_records: int | None, *,
              retry_subtasks: bool = False, backend: str = "heap", retain: int = 3,
              max_parallelism: int = MAX_PARALLELISM, local_dir: str | None = None,
              run_subtask: Callable[..., SubtaskReport] = run_keyed_subtask,
              run_source: Callable[..., SourceReport] = run_source_subtask,
              at: Callable[[str], None] = no_fault, watermark_strategy: WatermarkStrategy | None = None,
              output_schema: pa.Schema = shop.ORDER_SCHEMA) -> tuple[CheckpointMetadata, pa.Table, int]:
    """One micro-batch as the Spark driver runs it (the same driver), its subtasks called through ``run_subtask``
    (``run_keyed_subtask`` in this process by default) and ``run_source`` (``run_source_subtask``), reading
    ``log_dir``: a partitioned-log directory or any source (a KafkaSource). Returns the committed metadata, its
    output (orders, of ``output_schema``) and the number of records the sources read. ``at(point)`` is called at
    ``"source"`` (after each source subtask) and ``"reported"`` (every subtask has reported; the driver is about to
    commit): the fault campaign's kill points. With a ``watermark_strategy`` the job runs on event time (column
    ``ts``): the driver moves the watermark from the batch's largest event time, as the Spark job does."""
    storage = CheckpointStorage(location, retain=retain)
    plan = begin_batch(storage, job_name=JOB_NAME, max_parallelism=max_parallelism, parallelism=parallelism)
    source = plan.source_task(log_dir, record_schema=shop.EVENT_SCHEMA, max_records_per_subtask=max_records)
    sources = []
    for i in range(parallelism):
        sources.append(run_source(source, i))
        at("source")
    tables = [pq.read_table(io.BytesIO(storage.read_bytes(r.input_file))) for r in sources if r.input_file]
    schema = source.staged_schema
    staged = pa.concat_tables(tables) if tables else schema.empty_table()
    owners = kg.assign_operators(staged.column("user"), max_parallelism, parallelism)
    watermark = None
    if watermark_strategy is not None:
        watermark = watermark_strategy.next_watermark(plan.start_watermark, pc.max(staged.column("ts")).as_py())
    spec = plan.keyed_task(key_columns=("user",), function=pickle.dumps(function), input_schema=schema,
                           output_schema=output_schema, order_columns=("_partition", "_offset"), backend=backend,
                           local_dir=local_dir, timestamp_column="ts" if watermark_strategy is not None else None,
                           watermark=watermark)
    reports = []
    for i in range(parallelism):
        part = staged.filter(pa.array(owners == i))
        if part.num_rows == 0:  # Spark runs no task for an empty partition: the driver runs it as an idle subtask
            continue
        batches = part.to_batches()
        if retry_subtasks:  # a first attempt that succeeded but whose report Spark discarded
            run_subtask(spec, i, batches)
        reports.append(run_subtask(spec, i, batches))
    reports += [run_subtask(spec, i, []) for i in plan.idle_subtasks(reports)]
    at("reported")
    metadata = commit_batch(plan, reports, sources, watermark=watermark)
    source.source.notify_checkpoint_complete(metadata)
    return metadata, read_outputs(storage, metadata, output_schema), sum(r.records for r in sources)


def read_outputs(storage: CheckpointStorage, metadata: CheckpointMetadata,
                 schema: pa.Schema = shop.ORDER_SCHEMA) -> pa.Table:
    """A committed checkpoint's output (the orders its subtasks wrote, of ``schema``), as one table."""
    orders = [pq.read_table(io.BytesIO(storage.read_bytes(f))) for f in metadata.outputs]
    return pa.concat_tables(orders) if orders else schema.empty_table()


def final_states(location: str, max_parallelism: int = MAX_PARALLELISM) -> dict[str, shop.UserState]:
    """Every user's state in the latest complete checkpoint, restored into one heap backend over all key groups."""
    storage = CheckpointStorage(location)
    backend = create_backend("heap", kg.key_group_range(max_parallelism, 1, 0), max_parallelism, "string")
    backend.restore(storage, storage.latest())
    return dict(shop.read_user_states(backend))


def rows(table: pa.Table) -> list[tuple]:
    """The orders of ``table`` as tuples in ``shop.ORDER_SCHEMA`` order, sorted (the reference's form)."""
    return sorted(zip(*[table.column(n).to_pylist() for n in shop.ORDER_SCHEMA.names]))
