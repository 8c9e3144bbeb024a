"""The harness against a plain-Python model: random batches of records, watermark and processing-time advances,
snapshots and restores at another parallelism, max parallelism (an integer factor) and backend; after every step
the harness's output, late records, state (five kinds, processing-time TTL) and timers equal the model's."""

from __future__ import annotations

import heapq
import operator

import pyarrow as pa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keygroups.runtime import NO_WATERMARK, KeyedProcessFunction, TimeDomain, WatermarkStrategy
from keygroups.serializers import Int64Serializer
from keygroups.state import (
    ListStateDescriptor,
    MapStateDescriptor,
    ReducingStateDescriptor,
    StateTtlConfig,
    ValueStateDescriptor,
)
from keygroups.testing import Timer

INPUT = pa.schema([("k", pa.int64()), ("v", pa.int64()), ("ts", pa.int64()), ("seq", pa.int64())])
OUTPUT = pa.schema([("kind", pa.string()), ("k", pa.int64()), ("a", pa.int64()), ("b", pa.int64())])
TTL_MS = 100
EVENT_DELAY = 10


class Accounts(KeyedProcessFunction):
    """Per key: a running total (value), every value (list), the last value per residue mod 3 (map), a count
    (reducing) and the latest value with a processing-time TTL. A value divisible by 5 sets an event-time timer
    ``EVENT_DELAY`` after its event time, by 7 a processing-time timer ``v % 50`` ms from now, by 11 deletes the
    key's event-time timer at ``ts + EVENT_DELAY``. Timers emit the key's total."""

    def open(self, context):
        self.total = context.get_state(ValueStateDescriptor("total", Int64Serializer()))
        self.values = context.get_list_state(ListStateDescriptor("values", Int64Serializer()))
        self.last = context.get_map_state(MapStateDescriptor("last", Int64Serializer(), Int64Serializer()))
        self.count = context.get_reducing_state(ReducingStateDescriptor("count", operator.add, Int64Serializer()))
        recent = ValueStateDescriptor("recent", Int64Serializer())
        recent.enable_time_to_live(StateTtlConfig.new_builder(TTL_MS / 1000).build())
        self.recent = context.get_state(recent)

    def process_element(self, record, context):
        v, ts = record["v"], record["ts"]
        total = (self.total.value() or 0) + v
        self.total.update(total)
        self.values.add(v)
        self.last.put(v % 3, v)
        self.count.add(1)
        self.recent.update(v)
        timers = context.timer_service
        if v % 5 == 0:
            timers.register_event_time_timer(ts + EVENT_DELAY)
        if v % 7 == 0:
            timers.register_processing_time_timer(timers.current_processing_time() + v % 50)
        if v % 11 == 0:
            timers.delete_event_time_timer(ts + EVENT_DELAY)
        yield ("record", context.current_key, v, total)

    def on_timer(self, timestamp, context):
        kind = "event" if context.time_domain is TimeDomain.EVENT_TIME else "processing"
        yield (kind, context.current_key, timestamp, self.total.value() or 0)


class Model:
    """The same, with dicts."""

    def __init__(self) -> None:
        self.total: dict[int, int] = {}
        self.values: dict[int, list[int]] = {}
        self.last: dict[int, dict[int, int]] = {}
        self.recent: dict[int, tuple[int, int]] = {}   # key -> (value, processing time written)
        self.timers: dict[TimeDomain, set[tuple[int, int]]] = {d: set() for d in TimeDomain}   # (ts, key)
        self.watermark: int | None = None
        self.clock = 0

    def batch(self, records, strategy_delay):
        out, late = [], []
        start = self.watermark
        for r in records:
            k, v, ts = r["k"], r["v"], r["ts"]
            if start is not None and ts <= start:
                late.append(r)
                continue
            total = self.total.get(k, 0) + v
            self.total[k] = total
            self.values.setdefault(k, []).append(v)
            self.last.setdefault(k, {})[v % 3] = v
            self.recent[k] = (v, self.clock)
            if v % 5 == 0:
                self.timers[TimeDomain.EVENT_TIME].add((ts + EVENT_DELAY, k))
            if v % 7 == 0:
                self.timers[TimeDomain.PROCESSING_TIME].add((self.clock + v % 50, k))
            if v % 11 == 0:
                self.timers[TimeDomain.EVENT_TIME].discard((ts + EVENT_DELAY, k))
            out.append({"kind": "record", "k": k, "a": v, "b": total})
        if records and strategy_delay is not None:
            candidate = max(r["ts"] for r in records) - strategy_delay - 1
            self.watermark = candidate if start is None else max(start, candidate)
        return out + self.fire(), late

    def fire(self):
        out = []
        for domain, until, kind in ((TimeDomain.EVENT_TIME, self.watermark, "event"),
                                    (TimeDomain.PROCESSING_TIME, self.clock, "processing")):
            if until is None:
                continue
            due = sorted(t for t in self.timers[domain] if t[0] <= until)
            heapq.heapify(due)
            for ts, k in due:
                self.timers[domain].discard((ts, k))
                out.append({"kind": kind, "k": k, "a": ts, "b": self.total.get(k, 0)})
        return out

    def state(self, k, name):
        if name == "total":
            return self.total.get(k)
        if name == "values":
            return self.values.get(k, [])
        if name == "last":
            return self.last.get(k, {})
        if name == "count":
            return len(self.values[k]) if k in self.values else None
        value, written = self.recent.get(k, (None, None))
        return value if value is not None and written + TTL_MS > self.clock else None

    def timer_list(self, k=None):
        order = {TimeDomain.EVENT_TIME: 0, TimeDomain.PROCESSING_TIME: 1}
        timers = [Timer(key, d, ts) for d, entries in self.timers.items() for ts, key in entries
                  if k is None or key == k]
        return sorted(timers, key=lambda t: (t.timestamp, order[t.domain], t.key))


def per_key(rows):
    """Each key's rows in the order they came (order across keys is by key group, which the model does not
    compute)."""
    out: dict[int, list[dict]] = {}
    for r in rows:
        out.setdefault(r["k"], []).append(r)
    return out


record = st.fixed_dictionaries({"k": st.integers(0, 11), "v": st.integers(0, 120), "ts": st.integers(0, 400)})
step = st.one_of(
    st.tuples(st.just("process"), st.lists(record, max_size=20)),
    st.tuples(st.just("watermark"), st.integers(0, 80)),
    st.tuples(st.just("clock"), st.integers(0, 120)),
    st.tuples(st.just("restore"), st.tuples(st.integers(1, 4), st.sampled_from([1, 2, 0.5]),
                                            st.sampled_from(["heap", "rocksdb"]))),
)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(step, min_size=1, max_size=8), strategy=st.sampled_from([None, 0, 15]),
       start=st.tuples(st.integers(1, 3), st.sampled_from(["heap", "rocksdb"]), st.sampled_from([4, 0])))
def test_the_harness_matches_a_dict_model(keygroups_harness, steps, strategy, start):
    parallelism, backend, warm = start   # warm 0: every batch restores its state from the checkpoint
    harness = keygroups_harness(
        Accounts(), "k", output_schema=OUTPUT, input_schema=INPUT, max_parallelism=16, parallelism=parallelism,
        backend=backend, order_by=["seq"], timestamp_column="ts",
        watermark_strategy=None if strategy is None else WatermarkStrategy(strategy), warm_heap_backends=warm)
    model = Model()
    seq = 0
    for kind, arg in steps:
        if kind == "process":
            records = [{**r, "seq": seq + i} for i, r in enumerate(arg)]
            seq += len(records)
            report = harness.process(records)
            expected, late = model.batch(records, strategy)
            assert report.records_in == len(records) and report.records_late == len(late)
            assert sorted(harness.late(), key=lambda r: r["seq"]) == late
        elif kind == "watermark":
            target = (model.watermark or 0) + arg
            harness.advance_watermark(target)
            model.watermark = target
            expected = model.fire()
        elif kind == "clock":
            model.clock += arg
            harness.advance_processing_time(model.clock)
            expected = model.fire()
        elif harness.checkpoint is not None:
            p, factor, new_backend = arg
            snapshot = harness.snapshot()
            mp = int(harness.max_parallelism * factor)
            mp = mp if 4 <= mp <= 64 else harness.max_parallelism
            restored = harness.restore(snapshot, parallelism=min(p, mp), max_parallelism=mp, backend=new_backend)
            harness.close()
            harness = restored
            expected = []
        else:
            expected = []
        got = harness.output()
        assert sorted(got, key=repr) == sorted(expected, key=repr)
        assert per_key(got) == per_key(expected)
        for k in range(12):
            for name in ("total", "values", "last", "count", "recent"):
                assert harness.state(k, name) == model.state(k, name), (k, name)
        assert harness.timers() == model.timer_list()
        assert harness.timers(3) == model.timer_list(3)
        assert harness.watermark == (NO_WATERMARK if model.watermark is None else model.watermark)
