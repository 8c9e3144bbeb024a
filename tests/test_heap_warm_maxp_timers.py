"""Through the job's own subtask code (``KeyedFunctionHarness``) at max parallelism 4096: a job whose heap state
stays warm between batches emits exactly what the same job restoring every batch cold emits, with event-time and
processing-time timers (kept as keyed state) firing across batches."""

from __future__ import annotations

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from keygroups.runtime import KeyedProcessFunction
from keygroups.serializers import Int64Serializer
from keygroups.state import ListStateDescriptor, ValueStateDescriptor
from keygroups.state.timers import TimeDomain
from keygroups.testing import KeyedFunctionHarness

OUTPUT = pa.schema([("key", pa.int64()), ("count", pa.int64()), ("fired", pa.int64()), ("seen", pa.int64())])
INPUT = pa.schema([("key", pa.int64()), ("value", pa.int64()), ("ts", pa.int64())])


class Timed(KeyedProcessFunction):
    """Per key a count and the values seen; each record sets an event-time timer 3 ms after its time and a
    processing-time timer 5 ms from now. An event-time timer reports the key; a processing-time one reports it and
    clears its state."""

    def open(self, context):
        self.count = context.get_state(ValueStateDescriptor("count", Int64Serializer()))
        self.seen = context.get_state(ListStateDescriptor("seen", Int64Serializer()))

    def process_element(self, record, context):
        n = (self.count.value() or 0) + 1
        self.count.update(n)
        self.seen.add(record["value"])
        timers = context.timer_service
        timers.register_event_time_timer(record["ts"] + 3)
        timers.register_processing_time_timer(timers.current_processing_time() + 5)
        return [(context.current_key, n, -1, len(self.seen.get()))]

    def on_timer(self, timestamp, context):
        row = (context.current_key, self.count.value() or 0, timestamp, len(self.seen.get()))
        if context.time_domain is TimeDomain.PROCESSING_TIME:
            self.count.clear()
            self.seen.clear()
        return [row]


def harness(warm: int) -> KeyedFunctionHarness:
    return KeyedFunctionHarness(Timed(), "key", output_schema=OUTPUT, input_schema=INPUT, max_parallelism=4096,
                                parallelism=2, timestamp_column="ts", warm_heap_backends=warm)


steps = st.lists(st.one_of(
    st.tuples(st.just("records"), st.lists(st.tuples(st.integers(0, 60), st.integers(0, 20)), min_size=1,
                                           max_size=12)),
    st.tuples(st.just("watermark"), st.integers(1, 8)),
    st.tuples(st.just("processing time"), st.integers(1, 8))), min_size=2, max_size=8)


@pytest.mark.slow
@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(steps=steps)
def test_warm_state_with_timers_emits_what_restoring_every_batch_emits(steps):
    warm_modes = []
    with harness(4) as warm, harness(0) as cold:
        watermark = processing = 0
        for kind, arg in steps:
            for h in (warm, cold):
                if kind == "records":
                    batch = h.process(pa.table({"key": [k for k, _ in arg], "value": [v for _, v in arg],
                                                "ts": [watermark + 1 + v for _, v in arg]}, schema=INPUT))
                elif kind == "watermark":
                    batch = h.advance_watermark(watermark + arg)
                else:
                    batch = h.advance_processing_time(processing + arg)
                if h is warm:
                    warm_modes += batch.restored_modes
            if kind == "watermark":
                watermark += arg
            elif kind == "processing time":
                processing += arg
            assert warm.output() == cold.output()
    assert "cold" not in warm_modes[2:] and set(warm_modes[2:]) <= {"warm"}, warm_modes
