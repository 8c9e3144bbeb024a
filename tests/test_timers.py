"""Timers as keyed state, through the runtime (driver protocol and subtasks, no Spark): a model test of register,
delete and fire against a plain-dict model with rescales, warm and cold subtasks, retried attempts and both backends
between batches; then firing order, late records, no-data batches and the watermark across restarts."""

from __future__ import annotations

import dataclasses
import heapq
import pickle

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keygroups._parquet import read_parquet
import keygroups as kg
from keygroups.checkpoint import CheckpointStorage
from keygroups.runtime import NO_WATERMARK, KeyedProcessFunction, TimeDomain, WatermarkStrategy, begin_batch, commit_batch
from keygroups.runtime.subtask import run_keyed_subtask
from keygroups.runtime.subtask_state import HeapBackendRegistry
from keygroups.serializers import Int64Serializer
from keygroups.state import ValueStateDescriptor
from keygroups.state.timers import TimerQueueRegistry

MAX_PARALLELISM = 16
OPS = ("reg_e", "del_e", "reg_p", "del_p")
INPUT = pa.schema([("k", pa.int64()), ("op", pa.string()), ("ts", pa.int64()), ("seq", pa.int64())])
FIRED = pa.schema([("k", pa.int64()), ("domain", pa.string()), ("ts", pa.int64()), ("seen", pa.int64())])


class TimerOps(KeyedProcessFunction):
    """Registers and deletes the timers its records name; a firing event-time timer at a multiple of 7 registers
    another one 1 ms later (fired in the same advance if due). Each firing also reports how many records of its key
    the function saw (state read in on_timer)."""

    def open(self, context):
        self.seen = context.get_state(ValueStateDescriptor("seen", Int64Serializer()))

    def process_element(self, record, context):
        self.seen.update((self.seen.value() or 0) + 1)
        timers = context.timer_service
        ts = record["ts"]
        {"reg_e": timers.register_event_time_timer, "del_e": timers.delete_event_time_timer,
         "reg_p": timers.register_processing_time_timer, "del_p": timers.delete_processing_time_timer,
         }[record["op"]](ts)

    def on_timer(self, timestamp, context):
        if context.time_domain is TimeDomain.EVENT_TIME and timestamp % 7 == 0:
            context.timer_service.register_event_time_timer(timestamp + 1)
        yield (context.current_key, context.time_domain.value, timestamp, self.seen.value() or 0)


class Model:
    """Timers as a plain dict: (key, domain) -> set of timestamps, and records seen per key."""

    def __init__(self) -> None:
        self.timers: dict[tuple[int, str], set[int]] = {}
        self.seen: dict[int, int] = {}

    def apply(self, records: list[tuple[int, str, int]]) -> None:
        for k, op, ts in records:
            self.seen[k] = self.seen.get(k, 0) + 1
            domain = "event-time" if op.endswith("_e") else "processing-time"
            timers = self.timers.setdefault((k, domain), set())
            (timers.add if op.startswith("reg") else timers.discard)(ts)

    def fire(self, watermark: int, processing_time: int) -> list[tuple[int, str, int, int]]:
        fired = []
        for domain, until in (("event-time", watermark), ("processing-time", processing_time)):
            queue = [(ts, k) for (k, d), tss in self.timers.items() if d == domain for ts in tss if ts <= until]
            heapq.heapify(queue)
            while queue:
                ts, k = heapq.heappop(queue)
                self.timers[(k, domain)].discard(ts)
                fired.append((k, domain, ts, self.seen.get(k, 0)))
                if domain == "event-time" and ts % 7 == 0 and ts + 1 not in self.timers[(k, domain)]:
                    self.timers[(k, domain)].add(ts + 1)
                    if ts + 1 <= until:
                        heapq.heappush(queue, (ts + 1, k))
        return fired


def run_batch(location, parallelism, records, *, watermark=None, processing_time=0, backend="heap",
              heaps=None, queues=None, retry=()):
    """One batch of TimerOps through the driver protocol: subtasks in this process, those in ``retry`` run twice
    (the first attempt's report discarded, as Spark discards a retried task's). Returns the committed metadata and
    the fired rows."""
    storage = CheckpointStorage(location)
    plan = begin_batch(storage, job_name="timers", max_parallelism=MAX_PARALLELISM, parallelism=parallelism)
    plan = dataclasses.replace(plan, processing_time=processing_time)
    table = pa.Table.from_pylist([{"k": k, "op": op, "ts": ts, "seq": i} for i, (k, op, ts) in enumerate(records)],
                                 schema=INPUT)
    spec = plan.keyed_task(key_columns=("k",), function=pickle.dumps(TimerOps()), input_schema=INPUT,
                           output_schema=FIRED, order_columns=("seq",), backend=backend, watermark=watermark)
    owners = kg.assign_operators(table.column("k"), MAX_PARALLELISM, parallelism)
    heaps = heaps if heaps is not None else HeapBackendRegistry()
    queues = queues if queues is not None else TimerQueueRegistry()
    reports = []
    for i in range(parallelism):
        batches = table.filter(pa.array(owners == i)).to_batches()
        if i in retry:
            run_keyed_subtask(spec, i, batches, warm=heaps, warm_timers=queues)
        reports.append(run_keyed_subtask(spec, i, batches, warm=heaps, warm_timers=queues))
    metadata = commit_batch(plan, reports, watermark=watermark)
    fired = [row for f in metadata.outputs
             for row in read_parquet(storage.read_bytes(f)).to_pylist()]
    return metadata, [(r["k"], r["domain"], r["ts"], r["seen"]) for r in fired]


def per_key_order(fired):
    """Each key's firings per domain in the order they came: timestamp order is what Flink guarantees per key."""
    out: dict[tuple[int, str], list[int]] = {}
    for k, domain, ts, _ in fired:
        out.setdefault((k, domain), []).append(ts)
    return out


batch_strategy = st.fixed_dictionaries({
    "records": st.lists(st.tuples(st.integers(0, 11), st.sampled_from(OPS), st.integers(0, 60)), max_size=25),
    "parallelism": st.integers(1, 4),
    "advance": st.integers(0, 25),
    "clock": st.integers(0, 25),
    "warm": st.booleans(),
    "retry": st.sets(st.integers(0, 3), max_size=2),
})


@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=st.lists(batch_strategy, min_size=1, max_size=6))
def test_timers_match_a_dict_model_across_rescales_restores_and_retries(tmp_path_factory, backend, batches):
    location = str(tmp_path_factory.mktemp("timers"))
    model = Model()
    heaps, queues = HeapBackendRegistry(), TimerQueueRegistry()
    watermark, clock = -1, 0
    for b in batches:
        watermark += b["advance"]
        clock += b["clock"]
        if not b["warm"]:   # another worker process: nothing kept
            heaps, queues = HeapBackendRegistry(), TimerQueueRegistry()
        metadata, fired = run_batch(location, b["parallelism"], b["records"], watermark=watermark,
                                    processing_time=clock, backend=backend, heaps=heaps, queues=queues,
                                    retry={i for i in b["retry"] if i < b["parallelism"]})
        model.apply(b["records"])
        expected = model.fire(watermark, clock)
        assert sorted(fired) == sorted(expected)
        assert per_key_order(fired) == per_key_order(expected)
        pending = {d: sorted(ts for (k, dd), tss in model.timers.items() if dd == d for ts in tss)
                   for d in ("event-time", "processing-time")}
        summary = metadata.properties["timers"]
        for domain, timestamps in pending.items():
            assert summary[domain]["earliest"] == (timestamps[0] if timestamps else None)
        assert metadata.properties["watermark"] == max(watermark, NO_WATERMARK)


def test_kept_timer_queues_are_reused_only_for_the_snapshot_they_reflect(tmp_path):
    heaps, queues = HeapBackendRegistry(), TimerQueueRegistry()
    location, model = str(tmp_path), Model()

    def batch(parallelism, records, watermark, **kwargs):
        metadata, fired = run_batch(location, parallelism, records, watermark=watermark, heaps=heaps, queues=queues,
                                    **kwargs)
        model.apply(records)
        assert sorted(fired) == sorted(model.fire(watermark, 0))
        return [r["timers"]["event-time"]["rebuilt"] for r in metadata.properties["reports"]]

    assert batch(2, [(k, "reg_e", 100 + k) for k in range(50)], 0) == [True, True]
    # The same worker, the next batch: the queues reflect exactly the committed snapshot and are reused.
    assert batch(2, [], 120) == [False, False]
    # A batch whose first attempts were discarded: the kept queues are then those of an uncommitted attempt of the
    # same checkpoint, yet the next batch fires exactly the committed timers.
    batch(2, [(1, "reg_e", 500)], 130, retry={0, 1})
    batch(2, [], 10_000)
    # A rescale builds new queues from the state of the new key-group ranges.
    batch(3, [(7, "reg_e", 20_000)], 10_000)
    assert batch(1, [], 20_000) == [True]


class Late(KeyedProcessFunction):
    def process_element(self, record, context):
        yield (record["k"], "record", record["ts"], context.timestamp)


def test_records_at_or_before_the_start_watermark_are_late(tmp_path):
    location = str(tmp_path)
    storage = CheckpointStorage(location)
    strategy = WatermarkStrategy.for_bounded_out_of_orderness(0.01)   # 10 ms
    for records, late_mode in (([(1, "x", 100), (2, "x", 50)], "drop"), ([(1, "x", 89), (3, "x", 90)], "output")):
        plan = begin_batch(storage, job_name="late", max_parallelism=8, parallelism=1)
        table = pa.Table.from_pylist([{"k": k, "op": op, "ts": ts, "seq": 0} for k, op, ts in records], schema=INPUT)
        watermark = strategy.next_watermark(plan.start_watermark, max(table.column("ts").to_pylist()))
        spec = plan.keyed_task(key_columns=("k",), function=pickle.dumps(Late()), input_schema=INPUT,
                               output_schema=FIRED, timestamp_column="ts", watermark=watermark,
                               late_records=late_mode)
        metadata = commit_batch(plan, [run_keyed_subtask(spec, 0, table.to_batches())], watermark=watermark)
    # batch 1: watermark 100 - 10 - 1 = 89; batch 2 starts from it: 89 is late (at the watermark), 90 is not.
    assert metadata.properties["watermark"] == 89
    assert metadata.properties["records_late"] == 1
    [late_file] = metadata.late_outputs
    assert read_parquet(storage.read_bytes(late_file)).column("ts").to_pylist() == [89]
    out = read_parquet(storage.read_bytes(metadata.outputs[0])).to_pylist()
    assert [(r["k"], r["seen"]) for r in out] == [(3, 90)]


def test_a_batch_without_records_fires_due_timers_and_the_watermark_survives_restarts(tmp_path):
    location = str(tmp_path)
    run_batch(location, 2, [(k, "reg_e", 1_000 * k) for k in range(1, 6)] + [(9, "reg_p", 50)], watermark=10)
    # A new driver (nothing kept): the watermark comes from the checkpoint and never goes back.
    metadata, fired = run_batch(location, 4, [], watermark=5, processing_time=49)
    assert fired == [] and metadata.properties["watermark"] == 10
    metadata, fired = run_batch(location, 3, [], watermark=3_000, processing_time=50)
    assert sorted(fired) == [(1, "event-time", 1000, 1), (2, "event-time", 2000, 1), (3, "event-time", 3000, 1),
                             (9, "processing-time", 50, 1)]
    assert metadata.properties["timers"]["event-time"] == {"queued": 2, "registered": 0, "fired": 3, "pending": 2,
                                                            "earliest": 4000}


class Bad(KeyedProcessFunction):
    def __init__(self, action):
        self.action = action

    def open(self, context):
        if self.action == "reserved":
            context.get_state(ValueStateDescriptor("_timers/event-time", Int64Serializer()))

    def process_element(self, record, context):
        if self.action == "float":
            context.timer_service.register_event_time_timer(1.5)
        if self.action == "huge":
            context.timer_service.register_processing_time_timer(2**63)



def test_timer_arguments_and_reserved_state_names_are_checked(tmp_path):
    storage = CheckpointStorage(str(tmp_path))
    table = pa.Table.from_pylist([{"k": 1, "op": "x", "ts": 1, "seq": 0}], schema=INPUT)
    for action, error, words in (("reserved", ValueError, "reserved"), ("float", TypeError, "epoch milliseconds"),
                                 ("huge", ValueError, "64-bit")):
        plan = begin_batch(storage, job_name="bad", max_parallelism=8, parallelism=1)
        spec = plan.keyed_task(key_columns=("k",), function=pickle.dumps(Bad(action)), input_schema=INPUT,
                               output_schema=FIRED)
        with pytest.raises(error, match=words):
            run_keyed_subtask(spec, 0, table.to_batches(), warm=HeapBackendRegistry(),
                              warm_timers=TimerQueueRegistry())


def test_watermark_strategy_follows_flink():
    s = WatermarkStrategy.for_bounded_out_of_orderness(2)
    assert s.next_watermark(NO_WATERMARK, None) == NO_WATERMARK
    assert s.next_watermark(NO_WATERMARK, 10_000) == 7_999
    assert s.next_watermark(9_000, 10_000) == 9_000          # never goes back
    assert WatermarkStrategy.for_monotonous_timestamps().next_watermark(0, 5) == 4
    with pytest.raises(ValueError, match=">= 0"):
        WatermarkStrategy.for_bounded_out_of_orderness(-1)
    with pytest.raises(TypeError, match="timedelta"):
        WatermarkStrategy.for_bounded_out_of_orderness("5s")


def test_kept_state_is_watched_as_the_same_objects_batch_after_batch_until_a_rescale_drops_it(tmp_path):
    """What a Spark worker compares to tell warm state dropped (``keygroups.spark._worker_gc``): batch after batch
    the registries keep the same heap backend and the same timer heaps (the TimerQueues and its token are new each
    batch); a rescale that moves the range drops them."""
    from keygroups.state.warm import kept_object_ids

    heaps, queues = HeapBackendRegistry(), TimerQueueRegistry()
    location = str(tmp_path)
    records = [(k, "reg_e", 50 + k) for k in range(12)] + [(k, "reg_p", 90) for k in range(12)]
    outside = kept_object_ids()   # the process's other registries, untouched here
    run_batch(location, 2, records, watermark=0, heaps=heaps, queues=queues)
    first = kept_object_ids() - outside
    assert len(first) == 6   # per subtask: a heap backend, its event-time and processing-time heaps
    for _ in range(2):
        run_batch(location, 2, records[:3], watermark=1, heaps=heaps, queues=queues)
        assert kept_object_ids() - outside == first
    run_batch(location, 1, records[:3], watermark=2, heaps=heaps, queues=queues)   # one takes over, one dropped
    assert not first <= kept_object_ids()
