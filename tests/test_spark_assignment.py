"""Balanced key-group ranges on a real local Spark session: partition_by_key_group places records by explicit ranges
(both placement methods), and a KeyedJob with ``assignment="balanced"`` moves its boundaries on skewed input, rescales
with them, and switches back to Flink's ranges, its state equal to the reference throughout."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from pyspark.sql import functions as F

import keygroups as kg
from keygroups._ranges import flink_boundaries, operator_indexes_for_boundaries
from keygroups.runtime.assignment import DECISION_PROPERTY, RANGES_PROPERTY, BalancedRanges
from keygroups.spark import KeyedJob, partition_by_key_group
from spark_functions import TOTALS, RunningTotal

pytestmark = pytest.mark.spark
MP = 32


@pytest.mark.parametrize("method", ["auto", "hash"])
def test_partition_by_explicit_ranges_places_every_record_in_its_range(spark, method):
    boundaries = (0, 3, 4, 20, 32)
    df = spark.range(0, 3000).withColumnRenamed("id", "k")
    placed = partition_by_key_group(df, "k", max_parallelism=MP, parallelism=4, key_group_boundaries=boundaries,
                                    key_group_col="kg", operator_col="op", method=method)
    rows = placed.select("k", "kg", "op", F.spark_partition_id().alias("pid")).collect()
    keys = pa.array([r["k"] for r in rows], pa.int64())
    groups = kg.assign_key_groups(keys, MP, "long")
    owners = operator_indexes_for_boundaries(boundaries, groups)
    assert [r["kg"] for r in rows] == groups.tolist()
    assert [r["op"] for r in rows] == [r["pid"] for r in rows] == owners.tolist()
    with pytest.raises(ValueError, match="strictly ascending"):
        partition_by_key_group(df, "k", max_parallelism=MP, parallelism=3, key_group_boundaries=(0, 5, 5, 32))


def skewed_rows(batch: int) -> list[tuple[int, int]]:
    keys = np.arange(400)
    groups = kg.assign_key_groups(pa.array(keys, pa.int64()), MP, "long")
    hot = keys[groups < 5][:12]
    rows = [(int(k), 1) for k in keys[batch::3]]
    rows += [(int(k), 10) for k in hot for _ in range(25)]
    return rows


def test_balanced_job_moves_boundaries_rescales_and_switches_back(spark, tmp_path):
    location = str(tmp_path / "chk")
    # a forecast trusted once measured on one batch (the default waits for four), to keep the Spark batches few
    job = KeyedJob("skew", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MP,
                   checkpoint_location=location, assignment=BalancedRanges(evidence=1, caution=0))
    expected: dict[int, int] = {}
    ranges = []
    for batch, p in enumerate([3, 3, 3, 5]):
        rows = skewed_rows(batch)
        result = job.run_batch(spark.createDataFrame(rows, "k long, v long"), parallelism=p)
        for k, v in rows:
            expected[k] = expected.get(k, 0) + v
        finals = {}
        for k, total, _ in sorted(map(tuple, result.output.collect()), key=lambda r: (r[0], r[1])):
            finals[k] = total
        assert all(finals[k] == expected[k] for k in finals)
        props = result.metadata.properties
        ranges.append(tuple(props[RANGES_PROPERTY]))
        assert [r.key_group_range for r in result.reports] == [
            kg.KeyGroupRange(ranges[-1][i], ranges[-1][i + 1] - 1) for i in range(p)]
    assert ranges[0] == flink_boundaries(MP, 3)                  # nothing measured before the first batch
    assert ranges[1] == flink_boundaries(MP, 3)                  # a forecast, not yet measured on a batch
    assert ranges[2] != flink_boundaries(MP, 3) and ranges[3] != flink_boundaries(MP, 5)
    decision = job.latest_checkpoint().properties[DECISION_PROPERTY]
    assert decision["max_over_mean"] < decision["flink_max_over_mean"]

    back = KeyedJob("skew", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MP,
                    checkpoint_location=location)            # the default: Flink's ranges again
    rows = [(k, 1000) for k in range(400)]
    result = back.run_batch(spark.createDataFrame(rows, "k long, v long"), parallelism=4)
    assert tuple(result.metadata.properties[RANGES_PROPERTY]) == flink_boundaries(MP, 4)
    assert [r.key_group_range for r in result.reports] == [kg.key_group_range(MP, 4, i) for i in range(4)]
    totals = {k: t for k, t, _ in map(tuple, result.output.collect())}
    assert totals == {k: expected.get(k, 0) + 1000 for k in range(400)}


def test_moved_boundaries_read_exactly_the_moved_bytes_on_spark(spark, tmp_path):
    """Two of three boundaries move (the first subtask's largest overlap is the range the second needs): Spark's
    tasks, on whichever Python worker, take over the warm RocksDB databases the decision's best matching gives them
    (kept on the host's disk), so the batch restores exactly the moved bytes, and the totals stay right. Each batch
    writes its databases (``write_back_batches=1``): with write-back, a database taken over in another worker than
    the one that kept its newest values also reads the blocks it lags behind (test_rocksdb_takeover)."""
    from test_assignment_runtime import FixedRanges

    assignment = FixedRanges((0, 4, 25, MP))
    job = KeyedJob("moves", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MP, backend="rocksdb",
                   checkpoint_location=str(tmp_path / "chk"), local_dir=str(tmp_path / "local"),
                   assignment=assignment, write_back_batches=1)
    df = spark.createDataFrame([(k, 1) for k in range(3000)], "k long, v long")
    job.run_batch(df, parallelism=3)
    assignment.boundaries = (0, 15, 24, MP)
    result = job.run_batch(df, parallelism=3)
    report, decision = result.report, result.report.assignment
    assert decision is not None and decision.takeover == (0, 1, 2)
    assert report.bytes_restored == decision.moved_bytes > 0
    assert report.key_groups_cold == decision.moved_key_groups == 12
    assert sorted(r.restored.mode for r in result.reports) == ["moved"] * 3
    assert {k: t for k, t, _ in map(tuple, result.output.collect())} == {k: 2 for k in range(3000)}
