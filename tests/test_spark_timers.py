"""Event time and timers on Spark: an inactivity timeout over a timestamp column, rescaled between batches, through
``run_batch`` and through a streaming ``foreachBatch`` query; late records; a task killed while its timers fire."""

from __future__ import annotations

import datetime
import os
import random
import sys

from pyspark import cloudpickle

from keygroups.runtime import NO_WATERMARK, KeyedProcessFunction, WatermarkStrategy
from keygroups.serializers import Int64Serializer
from keygroups.spark import KeyedJob
from keygroups.state import ValueStateDescriptor

cloudpickle.register_pickle_by_value(sys.modules[__name__])

GAP_MS = 30_000
DELAY = datetime.timedelta(seconds=5)
EPOCH = datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
OUTPUT = "user long, timeout_at long, last_seen long, events long"


class Inactivity(KeyedProcessFunction):
    """A user is inactive ``GAP_MS`` of event time after their latest event: one event-time timer per user, moved
    forward by each event; when it fires, the user's activity is emitted and cleared."""

    def open(self, context):
        self.last = context.get_state(ValueStateDescriptor("last", Int64Serializer()))
        self.events = context.get_state(ValueStateDescriptor("events", Int64Serializer()))

    def process_element(self, record, context):
        last = self.last.value()
        timers = context.timer_service
        if last is not None and context.timestamp > last:
            timers.delete_event_time_timer(last + GAP_MS)
        if last is None or context.timestamp > last:
            self.last.update(context.timestamp)
            timers.register_event_time_timer(context.timestamp + GAP_MS)
        self.events.update((self.events.value() or 0) + 1)

    def on_timer(self, timestamp, context):
        yield (context.current_key, timestamp, self.last.value(), self.events.value())
        self.last.clear()
        self.events.clear()


class DiesWhileFiring(Inactivity):
    """Kills the Python process running subtask 0 at its third timer, once (a lost executor mid-firing), leaving
    ``marker`` behind as proof. By subtask, not by Spark's partition and attempt: a subtask forwarded to the worker
    that holds its state warm runs there, with no ``TaskContext`` of its own; killing that worker fails the task
    that forwarded it just the same."""

    def __init__(self, marker):
        self.marker = marker

    def open(self, context):
        super().open(context)
        self.fired = 0

    def on_timer(self, timestamp, context):
        self.fired += 1
        if context.subtask_index == 0 and self.fired == 3:
            try:
                os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:   # the retry
                pass
            else:
                os._exit(17)
        return super().on_timer(timestamp, context)


def events(seed, batches=4, users=30, per_batch=60):
    """Batches of (user, epoch ms): time moves forward batch by batch, with some records out of order and some
    behind the watermark."""
    rnd = random.Random(seed)
    out, now = [], 0
    for _ in range(batches):
        batch = []
        for _ in range(per_batch):
            now += rnd.randint(0, 2_000)
            batch.append((rnd.randrange(users), now - rnd.choice([0, 0, 0, 3_000, 20_000])))
        out.append(batch)
    return out


def reference(batches, delay_ms):
    """The same job in plain Python: records at or before the watermark the batch started with are late; the rest
    run in event-time order per user; then the watermark becomes max(watermark, latest event time - delay - 1) and
    timers at or before it fire in timestamp order."""
    watermark, last, count, timers = NO_WATERMARK, {}, {}, {}
    fired, late = [], 0
    for batch in batches:
        on_time = [(u, t) for u, t in batch if t > watermark]
        late += len(batch) - len(on_time)
        for u, t in sorted(on_time, key=lambda r: (r[0], r[1])):
            if u not in last or t > last[u]:
                last[u] = t
                timers[u] = t + GAP_MS
            count[u] = count.get(u, 0) + 1
        if batch:
            watermark = max(watermark, max(t for _, t in batch) - delay_ms - 1)
        for u, at in sorted(((u, at) for u, at in timers.items() if at <= watermark), key=lambda x: x[1]):
            fired.append((u, at, last.pop(u), count.pop(u)))
            del timers[u]
    return sorted(fired), late


def frame(spark, batch):
    rows = [(u, EPOCH + datetime.timedelta(milliseconds=t)) for u, t in batch]
    return spark.createDataFrame(rows, "user long, at timestamp")


def epoch_ms(t):
    return t + int(EPOCH.timestamp() * 1000)


def shifted(fired):
    return sorted((u, epoch_ms(at), epoch_ms(last), n) for u, at, last, n in fired)


def job_of(tmp_path, function=None, **kwargs):
    return KeyedJob("inactivity", "user", function or Inactivity(), output_schema=OUTPUT, max_parallelism=32,
                    checkpoint_location=str(tmp_path / "chk"), timestamp_column="at", order_by=("at",),
                    watermark_strategy=WatermarkStrategy.for_bounded_out_of_orderness(DELAY), **kwargs)


def test_event_time_timers_fire_across_rescales_as_the_reference(any_spark, tmp_path):
    spark = any_spark
    day = 86_400_000
    # The empty batch fires nothing new (its watermark stays); the last one, a day later, fires every timer left.
    batches = events(seed=1) + [[], [(999, day)]]
    expected, expected_late = reference(batches, 5_000)
    job = job_of(tmp_path, late_records="output")
    fired, late, watermarks = [], 0, []
    for batch, p in zip(batches, [2, 3, 1, 4, 2, 3]):
        result = job.run_batch(frame(spark, batch), parallelism=p)
        fired += [tuple(r) for r in result.output.collect()]
        late += result.late_output.count()
        assert result.records_late == result.late_output.count()
        watermarks.append(result.watermark)
    assert sorted(fired) == shifted(expected)
    assert late == expected_late > 0
    assert watermarks == sorted(watermarks) and watermarks[-1] == epoch_ms(day) - 5_001
    timers = job.latest_checkpoint().properties["timers"]["event-time"]
    assert timers["queued"] == 1 and timers["earliest"] == epoch_ms(day) + GAP_MS


def test_a_long_event_time_column_and_a_streaming_query(spark, tmp_path):
    batches = events(seed=2, batches=3)
    expected, expected_late = reference(batches, 5_000)
    source = tmp_path / "in"
    for i, batch in enumerate(batches):
        spark.createDataFrame(batch, "user long, at long").coalesce(1).write.parquet(str(source / f"part-{i}"))
    job = job_of(tmp_path)
    received: list = []
    run = job.foreach_batch(lambda out, _: received.extend(tuple(r) for r in out.collect()), parallelism=3)
    query = (spark.readStream.schema("user long, at long").option("maxFilesPerTrigger", 1)
             .parquet(str(source / "part-*")).writeStream.foreachBatch(run)
             .option("checkpointLocation", str(tmp_path / "spark-chk")).trigger(availableNow=True).start())
    query.awaitTermination(300)
    assert sorted(received) == expected
    latest = job.latest_checkpoint()
    assert latest.properties["watermark"] == max(t for b in batches for _, t in b) - 5_001
    assert sum(job.storage.load(i).properties["records_late"] for i in job.storage.checkpoint_ids()) == expected_late


def test_a_task_killed_while_its_timers_fire_fires_each_exactly_once(spark, tmp_path):
    batches = events(seed=3, batches=3)
    expected, _ = reference(batches, 5_000)
    fired = []
    for i, batch in enumerate(batches):
        job = job_of(tmp_path, DiesWhileFiring(str(tmp_path / "died")) if i == 2 else None)
        fired += [tuple(r) for r in job.run_batch(frame(spark, batch), parallelism=2).output.collect()]
    assert (tmp_path / "died").exists()
    assert sorted(fired) == shifted(expected)
