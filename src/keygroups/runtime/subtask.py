"""One keyed subtask of one micro-batch, as a Spark task runs it (no pyspark here, so it runs and tests alone).

its state (warm or restored: :mod:`keygroups.runtime.subtask_state`) → its records made ready
(:mod:`keygroups.runtime.subtask_input`) → the user's function over them, grouped by key, in order, then the timers
that are due → its output written → its state snapshotted → a :class:`~keygroups.runtime.report.SubtaskReport` to
the driver, which commits the checkpoint only once every subtask has reported.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
from collections.abc import Iterable
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from keygroups._native.recordloop import OutputSink, fire_timers, process_records
from keygroups._ranges import KeyGroupRange
from keygroups.checkpoint.raw_keyed import RawKeyedStateReader, write_raw_keyed_snapshot
from keygroups.runtime.assignment import encode_counts
from keygroups.runtime.functions import KeyedProcessFunction, ProcessContext, RuntimeContext, TimerService
from keygroups.runtime.report import SubtaskReport, SubtaskSeconds
from keygroups.runtime.sink import SinkCommittable, SinkContext, TaskSink
from keygroups.runtime.spec import KeyedTaskSpec
from keygroups.runtime.subtask_input import SubtaskInput, key_runs, prepare_input
from keygroups.runtime.subtask_state import HeapBackendRegistry, TaskState, task_state
from keygroups.runtime.warm_exchange import RUN_LOCK, SUPPORTED, process_exchange
from keygroups.state.timers import NO_WATERMARK, TimeDomain, TimerQueueRegistry, TimerQueues

_NO_STAMPS = np.zeros(0, dtype=np.int64)


def run_keyed_subtask(spec: KeyedTaskSpec, subtask_index: int, batches: Iterable[pa.RecordBatch], *,
                      warm: HeapBackendRegistry | None = None, warm_timers: TimerQueueRegistry | None = None,
                      attempt: int = 0, forward: bool = False) -> SubtaskReport:
    """Run one subtask of one micro-batch; returns its report for the driver's commit. A heap backend comes from,
    and after the batch goes back to, ``warm`` (this process's warm heap backends by default); timer queues
    likewise from ``warm_timers`` (:data:`~keygroups.state.timers.TIMER_QUEUES`). ``attempt``: the task's attempt
    number (Spark's), given to the sink's writer.

    ``forward`` (a Spark task, heap backend, this process's registries): when another Python process of this host
    holds more of the subtask's state warm than this one, the subtask runs there and this returns its report
    (:mod:`keygroups.runtime.warm_exchange`); else it runs here, one keyed subtask of the process at a time."""
    if not (forward and SUPPORTED) or spec.backend != "heap" or spec.warm_heap_backends == 0 or warm is not None \
            or warm_timers is not None:
        return _run_here(spec, subtask_index, batches, warm, warm_timers, attempt)
    exchange = process_exchange(_run_served)
    report = exchange.forward(spec, subtask_index, batches, attempt)
    if report is not None:
        return report
    try:
        with RUN_LOCK:
            return _run_here(spec, subtask_index, batches, None, None, attempt)
    finally:
        exchange.advertise()


def _run_served(spec: KeyedTaskSpec, subtask_index: int, batches: list[pa.RecordBatch],
                attempt: int) -> SubtaskReport:
    """A subtask forwarded to this process (which holds RUN_LOCK): run here, never forwarded again."""
    return _run_here(spec, subtask_index, batches, None, None, attempt)


def _run_here(spec: KeyedTaskSpec, subtask_index: int, batches: Iterable[pa.RecordBatch],
              warm: HeapBackendRegistry | None, warm_timers: TimerQueueRegistry | None,
              attempt: int) -> SubtaskReport:
    own = spec.own_key_groups(subtask_index)
    started = time.perf_counter()
    with task_state(spec, subtask_index, own, warm=warm, warm_timers=warm_timers) as state:
        return _run(spec, subtask_index, own, batches, state, time.perf_counter() - started, attempt)


def _load_function(spec: KeyedTaskSpec) -> KeyedProcessFunction:
    # The job's own code, pickled by the driver that submitted this task (as Spark ships every function): never
    # bytes read from a checkpoint or an input file.
    function = pickle.loads(spec.function)
    if not isinstance(function, KeyedProcessFunction):
        raise TypeError(f"the job's function must be a KeyedProcessFunction, got {type(function).__name__}")
    return function


def _run(spec: KeyedTaskSpec, subtask_index: int, own: KeyGroupRange, batches: Iterable[pa.RecordBatch],
         state: TaskState, restore_seconds: float, attempt: int) -> SubtaskReport:
    t = time.perf_counter()
    function = _load_function(spec)
    records = prepare_input(spec, subtask_index, own, batches, function.late_mask)
    prepared = time.perf_counter()

    backend, storage = state.backend, state.storage
    backend.watermark = spec.start_watermark
    backend.processing_time = spec.processing_time
    state.timers.attach(backend)
    function.open(RuntimeContext(backend, job_name=spec.job_name, subtask_index=subtask_index,
                                 parallelism=spec.parallelism, max_parallelism=spec.max_parallelism,
                                 checkpoint_id=spec.checkpoint_id))
    metadata = state.restore_point
    if metadata is not None and metadata.raw_keyed_handles:   # a fresh function object every batch: always read
        function.restore_raw_keyed_state(RawKeyedStateReader(storage, metadata, own,
                                                             max_parallelism=spec.max_parallelism))
    timer_service = TimerService(state.timers.get, watermark=spec.start_watermark,
                                 processing_time=spec.processing_time)
    context = ProcessContext(checkpoint_id=spec.checkpoint_id, subtask_index=subtask_index,
                             timer_service=timer_service)
    outputs = OutputSink(spec.output_schema)
    calls_per_group = _process(spec, function, backend, context, records, own, outputs)
    processed = time.perf_counter()

    timer_service._watermark = backend.watermark = spec.watermark
    fired_groups: list[int] = []
    if state.timers.queues is not None:
        _fire_timers(function, backend, state.timers.queues, context, outputs,
                     ((TimeDomain.EVENT_TIME, spec.watermark), (TimeDomain.PROCESSING_TIME, spec.processing_time)),
                     fired_groups)
    function.close()
    fired = time.perf_counter()

    output = outputs.table()
    with _task_sink(spec, subtask_index, attempt) as sink:   # its writer aborted if anything below fails
        committable = None
        if sink is not None:
            sink.write_table(output)
            committable = sink.prepare_commit()
        return _written(spec, subtask_index, own, state, function, records, output, committable,
                        restore_seconds, (t, prepared, processed, fired), calls_per_group, fired_groups)


def _task_sink(spec: KeyedTaskSpec, subtask_index: int, attempt: int) -> Any:
    """The job's sink opened for this subtask (:class:`~keygroups.runtime.sink.TaskSink`), or a null context."""
    if spec.sink is None:
        return contextlib.nullcontext()
    return TaskSink(spec.sink, SinkContext(spec.job_name, subtask_index, spec.parallelism, spec.checkpoint_id,
                                           spec.sink_run_id, attempt))


def _written(spec: KeyedTaskSpec, subtask_index: int, own: KeyGroupRange, state: TaskState,
             function: KeyedProcessFunction, records: SubtaskInput, output: pa.Table,
             committable: SinkCommittable | None, restore_seconds: float, clock: tuple[float, float, float, float],
             calls_per_group: np.ndarray, fired_groups: list[int]) -> SubtaskReport:
    """The subtask's output file (unless its output goes only to the sink), late file and state snapshot written;
    its report."""
    t, prepared, processed, fired = clock
    storage, backend = state.storage, state.backend
    output_file = None
    if spec.checkpoint_output:
        output_file = storage.new_file(spec.checkpoint_id, f"output-{subtask_index}") + ".parquet"
        with storage.open_write(output_file) as f:
            pq.write_table(output, f, **_parquet_options(output.schema))
    late_file = None
    if records.late.num_rows and spec.late_records == "output":
        late_file = storage.new_file(spec.checkpoint_id, f"late-{subtask_index}") + ".parquet"
        with storage.open_write(late_file) as f:
            pq.write_table(records.late, f)
    timers = state.timers.figures()  # before the snapshot: it reads state
    raw_handle = None
    if type(function).snapshot_raw_keyed_state is not KeyedProcessFunction.snapshot_raw_keyed_state:
        raw_handle = write_raw_keyed_snapshot(
            storage, storage.new_file(spec.checkpoint_id, f"raw-keyed-{subtask_index}"), subtask=subtask_index,
            key_groups=own, write=function.snapshot_raw_keyed_state)
    handle = backend.snapshot(spec.checkpoint_id, storage).result()
    done = time.perf_counter()
    state.timers.keep(spec.checkpoint_id, handle)
    live = records.event_times[records.event_times != NO_WATERMARK]
    return SubtaskReport(
        subtask=subtask_index, key_group_range=own, output_file=output_file, restored=state.restored,
        keyed_handle=handle, raw_keyed_handle=raw_handle, late_file=late_file, records_in=records.records_in,
        records_late=records.late.num_rows, records_out=output.num_rows,
        max_event_time=int(live.max()) if len(live) else None, event_time_range=records.event_time_range,
        timers=timers, snapshot_bytes=int(handle.size) if handle is not None else 0,
        raw_keyed_bytes=int(raw_handle.size) if raw_handle is not None else 0,
        state_entries=backend.estimated_entries(),
        seconds=SubtaskSeconds(restore=restore_seconds, prepare=prepared - t, process=processed - prepared,
                               timers=fired - processed, snapshot=done - fired),
        key_group_records=encode_counts(records.records_per_group), key_group_calls=encode_counts(calls_per_group),
        key_group_timers=encode_counts(np.bincount(np.asarray(fired_groups, dtype=np.int64) - own.start,
                                                   minlength=len(own))),
        sink_committable=committable, process=os.getpid())


def _parquet_options(schema: pa.Schema) -> dict[str, Any]:
    """How the output file encodes each column: integers, dates and times delta-encoded (a key sorted within its key
    group, a running count or sum shrink to a few bits a value, and the encoding is cheaper than a dictionary's),
    strings, binaries and nested columns with a dictionary, the rest (floats, booleans, decimals) plain."""
    delta = (pa.types.is_integer, pa.types.is_date, pa.types.is_timestamp, pa.types.is_time, pa.types.is_duration)
    plain = (pa.types.is_floating, pa.types.is_boolean, pa.types.is_decimal)
    deltas = [f.name for f in schema if any(is_(f.type) for is_ in delta)]
    dictionary = [f.name for f in schema if f.name not in deltas and not any(is_(f.type) for is_ in plain)]
    return {"use_dictionary": dictionary, "column_encoding": dict.fromkeys(deltas, "DELTA_BINARY_PACKED") or None}


def _process(spec: KeyedTaskSpec, function: KeyedProcessFunction, backend: Any, context: ProcessContext,
             records: SubtaskInput, own: KeyGroupRange, outputs: OutputSink) -> np.ndarray:
    """Run ``function`` over the records, key by key (per record, per key with the key's records, or the whole
    batch at once: whichever the function implements); returns its calls per key group (the load figures)."""
    table, groups = records.table, records.groups
    vectorized = type(function).process_key_batch is not KeyedProcessFunction.process_key_batch
    batched = type(function).process_batch is not KeyedProcessFunction.process_batch
    runs = key_runs(table, spec.key_columns)
    # the work per key group (the load figures): a step per key (the switch to it, its state), and one per record
    # when the function is called per record
    calls_per_group = np.bincount(groups[runs[:-1]] - own.start, minlength=len(own))
    if not (vectorized or batched):
        calls_per_group = calls_per_group + records.records_per_group
    # One Python key per run of equal keys, not per record.
    starts = pa.array(runs[:-1])
    run_keys = [table.column(c).take(starts).to_pylist() for c in spec.key_columns]
    keys = run_keys[0] if len(run_keys) == 1 else list(zip(*run_keys))
    if keys:
        backend.prefetch(keys, groups[runs[:-1]])
    if batched:
        if keys:
            def select_key(i: int) -> None:
                backend.set_current_key(keys[i])
                context.current_key, context.current_key_group = keys[i], backend.current_key_group

            result = function.process_batch(table, runs, keys, select_key, context)
            if result is not None:
                outputs.extend(result)
        return calls_per_group
    if not vectorized:   # per record: the compiled loop (keygroups._native.recordloop)
        process_records(function.process_element, backend.set_current_key, context, table, runs, keys,
                        np.ascontiguousarray(groups, dtype=np.int32),
                        records.event_times if spec.timestamp_column is not None else _NO_STAMPS, NO_WATERMARK,
                        outputs)
        return calls_per_group
    for i, key in enumerate(keys):
        lo, hi = int(runs[i]), int(runs[i + 1])
        backend.set_current_key(key)
        context.current_key, context.current_key_group = key, backend.current_key_group
        result = function.process_key_batch(key, table.slice(lo, hi - lo), context)
        if result is not None:
            outputs.append(result) if isinstance(result, pa.Table) else outputs.extend(result)
    return calls_per_group


def _fire_timers(function: KeyedProcessFunction, backend: Any, queues: TimerQueues, context: ProcessContext,
                 outputs: OutputSink, domains: Iterable[tuple[TimeDomain, int]], fired_groups: list[int]) -> None:
    """Fire each domain's timers due by its time, in timestamp order, after the batch's records, in the compiled
    loop (keygroups._native.recordloop.fire_timers; the keys of each run of due timers are prefetched together
    first: one read per run, not per timer, on RocksDB); the key group of each timer fired goes to ``fired_groups``
    (the load figures)."""
    for domain, until in domains:
        context.time_domain = domain
        fire_timers(function.on_timer, backend.set_current_key, backend.prefetch, context, queues.of(domain), until,
                    outputs, fired_groups)
    context.time_domain = None


__all__ = ["run_keyed_subtask", "KeyedTaskSpec"]
