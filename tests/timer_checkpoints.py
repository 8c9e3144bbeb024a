"""A job with timers in both time domains, run without Spark through the driver and subtasks, and the timers its
checkpoint must hold: for the offline readers' tests (state reader, ``keygroups inspect``)."""

from __future__ import annotations

import pickle
import random

import pyarrow as pa

import keygroups as kg
from keygroups.checkpoint import CheckpointStorage
from keygroups.runtime import begin_batch, commit_batch
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.runtime.subtask import run_keyed_subtask

MAXP = 16
#: Processing-time timers are registered this far out (2096): no batch's processing time reaches them.
FAR = 4_000_000_000_000
SCHEMA = pa.schema([("k", pa.int64()), ("t", pa.int64()), ("v", pa.int64())])
OUT = pa.schema([("k", pa.int64()), ("ts", pa.int64())])


class Reminders(KeyedProcessFunction):
    """Per record: an event-time timer at ``t + 100`` and a processing-time timer at ``FAR + t``; a record with
    ``v < 0`` deletes both again. A firing timer emits (key, timestamp)."""

    def process_element(self, row, ctx):
        timers = ctx.timer_service
        timers.register_event_time_timer(row["t"] + 100)
        timers.register_processing_time_timer(FAR + row["t"])
        if row["v"] < 0:
            timers.delete_event_time_timer(row["t"] + 100)
            timers.delete_processing_time_timer(FAR + row["t"])

    def on_timer(self, timestamp, ctx):
        return [(ctx.current_key, timestamp)]


def run_timer_job(location: str, *, seed: int = 3) -> tuple[CheckpointStorage, set[tuple[int, str, int]]]:
    """Two batches (parallelism 2, then 3; watermarks 500 and 1500) of records with distinct times; the storage
    and the timers its latest checkpoint must hold, as (key, domain, timestamp)."""
    storage = CheckpointStorage(location)
    rng = random.Random(seed)
    live: set[tuple[int, str, int]] = set()
    for parallelism, (lo, hi), watermark in ((2, (0, 1000), 500), (3, (1000, 2000), 1500)):
        times = rng.sample(range(lo, hi), 150)
        keys = [rng.randrange(30) for _ in times]
        values = [rng.choice([1, 1, 1, -1]) for _ in times]
        plan = begin_batch(storage, job_name="timers", max_parallelism=MAXP, parallelism=parallelism)
        spec = plan.keyed_task(key_columns=("k",), function=pickle.dumps(Reminders()), input_schema=SCHEMA,
                               output_schema=OUT, watermark=watermark)
        table = pa.table({"k": pa.array(keys, pa.int64()), "t": pa.array(times, pa.int64()),
                          "v": pa.array(values, pa.int64())})
        owners = kg.operator_index_for_key_group(MAXP, parallelism, kg.assign_key_groups(table.column("k"), MAXP))
        reports = [run_keyed_subtask(spec, i, table.filter(pa.array(owners == i)).to_batches())
                   for i in range(parallelism)]
        commit_batch(plan, reports, watermark=watermark)
        for k, t, v in zip(keys, times, values):
            if v >= 0:
                live |= {(k, "event-time", t + 100), (k, "processing-time", FAR + t)}
        live = {(k, d, ts) for k, d, ts in live if d != "event-time" or ts > watermark}   # fired
    return storage, live
