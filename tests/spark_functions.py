"""Keyed process functions shared by the test files, Spark's and the Spark-free spine's. Spark's Python workers
cannot import the tests directory, so this module ships by value."""

from __future__ import annotations

import sys

import pyarrow as pa
from pyspark import cloudpickle

from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.serializers import Int64Serializer
from keygroups.state import ValueStateDescriptor

cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: What RunningTotal emits per record: the key, its running total and the batch (checkpoint id).
TOTALS = pa.schema([("k", pa.int64()), ("total", pa.int64()), ("batch", pa.int64())])


class RunningTotal(KeyedProcessFunction):
    """Per key the running sum of its records' ``v``, emitted with every record."""

    def open(self, context):
        self.total = context.get_state(ValueStateDescriptor("total", Int64Serializer()))

    def process_element(self, record, context):
        total = (self.total.value() or 0) + record["v"]
        self.total.update(total)
        return [(context.current_key, total, context.checkpoint_id)]


#: What Total emits per record: the key and its running total.
KEY_TOTALS = pa.schema([("k", pa.int64()), ("total", pa.int64())])


class Total(KeyedProcessFunction):
    """Per key the running sum of its records' ``v``, emitted with every record."""

    def open(self, context):
        self.total = context.get_state(ValueStateDescriptor("total", Int64Serializer()))

    def process_element(self, record, context):
        total = (self.total.value() or 0) + record["v"]
        self.total.update(total)
        return [(context.current_key, total)]
