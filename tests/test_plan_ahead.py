"""Plans built ahead for a rescale (issue 32): a job told the parallelisms it switches between
(``KeyedJob.plan_ahead``) builds the other parallelism's keyed stage plan beside a batch, so the first batch at that
parallelism finds it built and plans nothing then; its results are those of a job that was not told."""

from __future__ import annotations

import sys

import pytest
from pyspark import cloudpickle

from keygroups.runtime.batch import JobDriver, PlansAhead
from keygroups.runtime.local import LocalExecutor
from keygroups.spark import KeyedJob
from keygroups.spark import executor as spark_executor
from spark_functions import TOTALS, RunningTotal

cloudpickle.register_pickle_by_value(sys.modules[__name__])
pytestmark = pytest.mark.spark
MAX_PARALLELISM = 32


def _built(job):
    """Wait for the plans being built ahead, then the (parallelism, built) of every stage plan the job holds."""
    for event in list(job._plans.building.values()):
        assert event.wait(120)
    return {key[2]: plan is not None for key, plan in job._plans.stages.items()}


def _rows(result):
    return sorted(tuple(r) for r in result.output.collect())


def test_the_first_batch_at_a_new_parallelism_finds_its_plan_built_ahead(spark, tmp_path, monkeypatch):
    built = []
    of = spark_executor.KeyedStagePlan.of

    def counted(*args, **kwargs):
        plan = of(*args, **kwargs)
        built.append(plan)
        return plan

    monkeypatch.setattr(spark_executor.KeyedStagePlan, "of", counted)
    told = KeyedJob("totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                    checkpoint_location=str(tmp_path / "told"))
    told.plan_ahead(2, 4)
    plain = KeyedJob("totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                     checkpoint_location=str(tmp_path / "plain"))
    batches = [[(k, 1) for k in range(40)], [(k, 10) for k in range(0, 40, 3)], [(k, 100) for k in range(40)]]
    first = told.run_batch(spark.createDataFrame(batches[0], "k long, v long"), parallelism=2)
    assert _built(told) == {2: True, 4: True}   # 4's plan, built beside the batch at 2
    assert len(built) == 2
    outputs = [_rows(first)]
    for rows, p in zip(batches[1:], (4, 2)):
        outputs.append(_rows(told.run_batch(spark.createDataFrame(rows, "k long, v long"), parallelism=p)))
    assert len(built) == 2   # neither the batch at 4 nor the one back at 2 planned its stage
    expected = [_rows(plain.run_batch(spark.createDataFrame(rows, "k long, v long"), parallelism=p))
                for rows, p in zip(batches, (2, 4, 2))]
    assert outputs == expected
    assert [(k, total) for k, total, _ in outputs[2]] == [(k, 111 if k % 3 == 0 else 101) for k in range(40)]


def test_plan_ahead_refuses_a_parallelism_outside_the_job_and_accepts_none(tmp_path):
    job = KeyedJob("totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                   checkpoint_location=str(tmp_path / "chk"))
    with pytest.raises(ValueError, match="parallelism must be in"):
        job.plan_ahead(2, MAX_PARALLELISM + 1)
    with pytest.raises(ValueError, match="parallelism must be in"):
        job.plan_ahead(0)
    job.plan_ahead()   # nothing ahead


def test_only_an_executor_that_can_plan_ahead_is_asked():
    assert isinstance(spark_executor.SparkExecutor.__new__(spark_executor.SparkExecutor), PlansAhead)
    assert not isinstance(LocalExecutor.__new__(LocalExecutor), PlansAhead)
    assert callable(JobDriver.plan_ahead)
