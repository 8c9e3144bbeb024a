"""The keyed functions the benchmarks of issues 32 and 33 run, written once so that every benchmark (and every
peer's job in benchmarks/java/ and _pyflink_job.py) does the same work.

- :class:`RunningValue`: one ValueState per key (a running sum), read and updated once per record, one output row
  ``(key, sum)`` per record (issue 32's batch and latency job).
- :class:`RunningCountSum`: two ValueStates per key (count, sum), each read and updated once per record, one output
  row ``(key, count, sum)`` per record (issue 33's peer job).

Both use only the public API (``KeyedProcessFunction.process_element``, ``ValueStateDescriptor``).
"""

from __future__ import annotations

import sys

import pyarrow as pa

from keygroups.runtime import KeyedProcessFunction
from keygroups.serializers import Int64Serializer
from keygroups.state import ValueStateDescriptor

VALUE_OUTPUT = pa.schema([("key", pa.int64()), ("sum", pa.int64())])
COUNT_SUM_OUTPUT = pa.schema([("key", pa.int64()), ("count", pa.int64()), ("sum", pa.int64())])
SUM = ValueStateDescriptor("sum", Int64Serializer())
COUNT = ValueStateDescriptor("count", Int64Serializer())


class RunningValue(KeyedProcessFunction):
    """Per record: the key's running sum of ``value`` (one ValueState), emitted as ``(key, sum)``."""

    def open(self, context):
        self.sum = context.get_state(SUM)

    def process_element(self, record, context):
        total = (self.sum.value() or 0) + record["value"]
        self.sum.update(total)
        return ((record["key"], total),)


class RunningCountSum(KeyedProcessFunction):
    """Per record: the key's running count and sum of ``value`` (two ValueStates), emitted as ``(key, count,
    sum)``."""

    def open(self, context):
        self.count = context.get_state(COUNT)
        self.sum = context.get_state(SUM)

    def process_element(self, record, context):
        count = (self.count.value() or 0) + 1
        total = (self.sum.value() or 0) + record["value"]
        self.count.update(count)
        self.sum.update(total)
        return ((record["key"], count, total),)


def ship_by_value() -> None:
    """Spark's Python workers cannot import this module from benchmarks/: pickle its functions by value."""
    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
