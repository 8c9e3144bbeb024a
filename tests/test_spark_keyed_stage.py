"""The keyed stage on Spark: the digest the checkpoint commits is the input's own (what a replay compares), whatever
the input's column names (names with a dot cross ``mapInArrow`` under plain names)."""

from __future__ import annotations

import sys

import pytest
from pyspark import cloudpickle

from keygroups.runtime import KeyedProcessFunction
from keygroups.runtime.properties import BatchProperties
from keygroups.runtime.report import InputDigest
from keygroups.serializers import Int64Serializer
from keygroups.spark import KeyedJob
from keygroups.spark.executor import input_digest
from keygroups.state import ValueStateDescriptor

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.spark


class Totals(KeyedProcessFunction):
    def __init__(self, value_column: str) -> None:
        self.value_column = value_column

    def open(self, context):
        self.total = context.get_state(ValueStateDescriptor("total", Int64Serializer()))

    def process_element(self, record, context):
        total = (self.total.value() or 0) + record[self.value_column]
        self.total.update(total)
        return [(context.current_key, total)]


def test_the_committed_digest_is_the_inputs_and_its_replay_returns_the_committed_output(spark, tmp_path):
    user, value = "a.user", "v.x"
    df = spark.createDataFrame([(i % 7, i) for i in range(50)], f"`{user}` long, `{value}` long")
    job = KeyedJob("stage", user, Totals(value), output_schema="user long, total long", max_parallelism=16,
                   checkpoint_location=str(tmp_path / "chk"), order_by=value)
    batch = job.run_batch(df, parallelism=2)
    # what the checkpoint committed is the digest of the input as given, computed by the tasks over the records
    # they got; a replay with the same records, computed on the driver, matches it
    assert BatchProperties.of(batch.metadata).input_digest == InputDigest.from_json(input_digest(df))
    replay = job.run_batch(df, parallelism=2, checkpoint_id=batch.checkpoint_id)
    assert replay.replayed
    rows = sorted((r["user"], r["total"]) for r in replay.output.collect())
    assert rows == sorted((i % 7, sum(j for j in range(i + 1) if j % 7 == i % 7)) for i in range(50))
