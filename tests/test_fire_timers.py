"""The compiled timer queue and firing loop (keygroups._native.recordloop.TimerHeap, fire_timers): the queue pops in
(timestamp, key group, sequence) order against heapq over tuples, whatever is pushed, extended and popped in
between; the loop fires through a real heap backend's hidden timer state in Flink's order (timers registered while
firing included), skips deleted timers, and puts back what an error left unfired. The runtime's model test of timers
(tests/test_timers.py) drives the same loop through whole batches on both backends."""

from __future__ import annotations

import heapq
import sys
from typing import Any

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keygroups import KeyGroupRange
from keygroups._native.recordloop import OutputSink, TimerHeap, fire_timers
from keygroups.runtime.functions import ProcessContext
from keygroups.serializers import StrSerializer
from keygroups.state.heap import HeapKeyedStateBackend
from keygroups.state.timers import TimeDomain, TimerQueues

INT64 = st.integers(-(2**63), 2**63 - 1)
OPS = st.lists(st.one_of(
    st.tuples(st.just("push"), st.integers(-5, 5), st.integers(0, 3), st.text(max_size=2)),
    st.tuples(st.just("extend"), st.lists(st.tuples(INT64, st.integers(0, 127), st.integers(0, 3)), max_size=6)),
    st.just(("pop",)), st.just(("head",))), max_size=60)


@settings(max_examples=200, deadline=None)
@given(OPS)
def test_the_timer_heap_pops_as_heapq_over_tuples(ops):
    heap, model, sequence = TimerHeap(), [], 0
    for op in ops:
        if op[0] == "push":
            _, timestamp, group, key = op
            heap.push(timestamp, group, sequence, key)
            heapq.heappush(model, (timestamp, group, sequence, key))
            sequence += 1
        elif op[0] == "extend":
            entries = [(t, g, sequence + i, ("k", i)) for i, (t, g, _) in enumerate(op[1])]
            sequence += len(entries)
            heap.extend(entries)
            model.extend(entries)
            heapq.heapify(model)
        elif op[0] == "head":
            assert heap.head() == (model[0] if model else None)
        elif model:
            assert heap.pop() == heapq.heappop(model)
        else:
            with pytest.raises(IndexError):
                heap.pop()
        assert len(heap) == len(model)
    assert sorted(heap.entries()) == sorted(model)
    assert [heap.pop() for _ in range(len(heap))] == sorted(model)


def test_a_timer_heap_refuses_a_timestamp_past_int64_and_keeps_its_keys_alive():
    heap = TimerHeap()
    with pytest.raises(OverflowError):
        heap.push(2**63, 0, 0, "k")
    with pytest.raises(OverflowError):
        heap.extend([(1, 0, 0, "a"), (2**64, 0, 1, "b")])
    assert heap.entries() == [(1, 0, 0, "a")]   # what came before the bad entry stays, ordered
    key = object()
    before = sys.getrefcount(key)
    heap.push(0, 0, 2, key)
    assert sys.getrefcount(key) == before + 1
    assert heap.pop()[3] is key
    assert sys.getrefcount(key) == before


class _Function:
    """on_timer of a KeyedProcessFunction: records each firing; at a multiple of 5 registers a timer 1 ms later and
    deletes the timer of key "b" at 7; raises at 99."""

    def __init__(self, queues: TimerQueues, backend: HeapKeyedStateBackend) -> None:
        self.queues, self.backend = queues, backend
        self.fired: list[tuple[int, Any, int]] = []

    def on_timer(self, timestamp: int, context: ProcessContext) -> Any:
        assert self.backend.current_key == context.current_key
        self.fired.append((timestamp, context.current_key, context.current_key_group))
        if timestamp == 99:
            raise RuntimeError("on_timer failed")
        if timestamp % 5 == 0:
            self.queues.event_time.register(timestamp + 1)
            key = self.backend.current_key
            self.backend.set_current_key("b")
            self.queues.event_time.delete(7)
            self.backend.set_current_key(key)
        return [(context.current_key, timestamp)]


def _backend() -> tuple[HeapKeyedStateBackend, TimerQueues]:
    backend = HeapKeyedStateBackend(KeyGroupRange(0, 127), 128, StrSerializer())
    return backend, TimerQueues(backend)


def test_timers_fire_in_order_with_the_ones_registered_while_firing():
    backend, queues = _backend()
    for key, timestamps in {"a": [10, 3, 7], "b": [7, 20, 3], "c": [5, 99, 4]}.items():
        backend.set_current_key(key)
        for t in timestamps:
            queues.event_time.register(t)
    function = _Function(queues, backend)
    context = ProcessContext(checkpoint_id=1, subtask_index=0)
    sink = OutputSink(pa.schema([("k", pa.string()), ("t", pa.int64())]))
    groups: list[int] = []
    prefetched: list[list[Any]] = []
    fire_timers(function.on_timer, backend.set_current_key, lambda keys, g: prefetched.append(keys), context,
                queues.event_time, 10, sink, groups)

    def group(key: str) -> int:
        backend.set_current_key(key)
        return backend.current_key_group

    order = sorted([(3, "a"), (3, "b"), (4, "c"), (5, "c"), (6, "c"), (7, "a"), (10, "a")],
                   key=lambda e: (e[0], group(e[1])))
    order = [e for e in order if e[1] != "b" or e[0] != 7]   # deleted at 5, before it was due
    assert [(t, k) for t, k, _ in function.fired] == order
    assert [g for _, _, g in function.fired] == [group(k) for _, k in order] == groups
    assert sink.table().to_pylist() == [{"k": k, "t": t} for t, k in order]
    assert queues.event_time.fired == len(order)
    assert sorted(prefetched[0]) == sorted(["a", "a", "a", "b", "b", "c", "c"])   # the first run's keys
    # 11 (registered at 10) is not due; b's 7 was deleted, its entry skipped
    assert sorted((t, k) for t, _, _, k in queues.event_time.queue.entries()) == [(11, "a"), (20, "b"), (99, "c")]
    assert queues.event_time.pending == 3

    with pytest.raises(RuntimeError, match="on_timer failed"):
        fire_timers(function.on_timer, backend.set_current_key, None, context, queues.event_time, 100, sink, groups)
    # 21 registered at 20 fires before 99, which raised (popped and removed from the state: the batch fails and is
    # retried from its checkpoint)
    assert [(t, k) for t, k, _ in function.fired[-4:]] == [(11, "a"), (20, "b"), (21, "b"), (99, "c")]
    assert len(queues.event_time.queue) == 0


def test_an_error_puts_the_rest_of_its_run_back():
    backend, queues = _backend()
    for key in ["a", "b", "c"]:
        backend.set_current_key(key)
        queues.processing_time.register(1)
    queues.processing_time.register(2)

    def on_timer(timestamp: int, context: ProcessContext) -> None:
        raise ValueError("first one fails")

    with pytest.raises(ValueError):
        fire_timers(on_timer, backend.set_current_key, None, ProcessContext(checkpoint_id=1, subtask_index=0),
                    queues.of(TimeDomain.PROCESSING_TIME), 5, OutputSink(pa.schema([("x", pa.int64())])), [])
    assert len(queues.processing_time.queue) == 3   # the run's three unfired entries are back
    assert queues.processing_time.fired == 1
