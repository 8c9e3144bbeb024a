"""The keyed stage's DataFrame on Spark: the input is placed by key group first, and the digest column (with the
plain names ``mapInArrow`` takes) is added by one projection after the shuffle; the digest the checkpoint commits is
still the input's own (what a replay compares)."""

from __future__ import annotations

import sys

import pytest
from pyspark import cloudpickle

from keygroups.runtime import KeyedProcessFunction
from keygroups.runtime.properties import BatchProperties
from keygroups.runtime.report import InputDigest
from keygroups.serializers import Int64Serializer
from keygroups.spark import KeyedJob
from keygroups.spark.executor import SparkExecutor, input_digest
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


class _Keeping(SparkExecutor):
    """A SparkExecutor that keeps the keyed stage's DataFrame it ran."""

    placed = None

    def run_keyed(self):
        type(self).placed = self._placed
        return super().run_keyed()


@pytest.mark.parametrize("names", [("user", "v"), ("a.user", "v.x")])
def test_the_shuffle_carries_the_input_and_the_committed_digest_is_the_inputs(spark, tmp_path, names):
    user, value = names
    df = spark.createDataFrame([(i % 7, i) for i in range(50)], f"`{user}` long, `{value}` long")
    job = KeyedJob("stage", user, Totals(value), output_schema="user long, total long", max_parallelism=16,
                   checkpoint_location=str(tmp_path / "chk"), order_by=value)
    driver = job.driver
    executor = _Keeping(spark, driver.options, job.storage, job._plans, df)
    batch = driver.run(executor, parallelism=2)

    plan = _Keeping.placed._jdf.queryExecution().executedPlan().toString()
    # the digest (xxhash64 over every column) is computed above the shuffle, over the placed records
    assert "xxhash64" in plan and plan.index("xxhash64") < plan.index("Exchange"), plan
    # what the checkpoint committed is the digest of the input as given (a replay of it is accepted)
    assert BatchProperties.of(batch.metadata).input_digest == InputDigest.from_json(input_digest(df))
    rows = sorted((r["user"], r["total"]) for r in
                  job.run_batch(df, parallelism=2, checkpoint_id=batch.checkpoint_id).output.collect())
    assert rows == sorted((i % 7, sum(j for j in range(i + 1) if j % 7 == i % 7)) for i in range(50))
