"""The multi-process Spark deployment of tests/spark_cluster.py: executors are separate JVMs and Python processes.

One cluster driver (a child process with its own SparkSession on ``local-cluster[2,1,1024]``, or whatever
``KEYGROUPS_SPARK_CLUSTER`` names) serves every test of this module; starting it costs most of the module's time.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest

from spark_cluster import ClusterCallError, ClusterDriver, cluster_fixture, task_processes

pytestmark = pytest.mark.cluster

MAX_PARALLELISM = 128

cluster = cluster_fixture()


def keyed_count_sum(spark, n_events: int, n_keys: int, partitions: int) -> dict:
    """Per-key (count, sum) of deterministic events, keyed by a hash shuffle and folded per partition on executors.

    Runs in the cluster driver. Each task also reports its Python pid and the key group keygroups' compiled kernel
    assigns to each key there, so the test can check that the compiled core works in executor processes.
    """
    import pandas as pd
    from pyspark.sql import functions as F

    def fold(batches):
        import os as _os
        import time as _time

        import keygroups as kg

        _time.sleep(0.3)  # hold the slot a moment, so that both executors get tasks
        parts = list(batches)
        if not parts:
            return
        pdf = pd.concat(parts)
        agg = pdf.groupby("key", sort=True)["value"].agg(["count", "sum"]).reset_index()
        agg["key_group"] = kg.assign_key_groups(agg["key"].to_numpy(), MAX_PARALLELISM).astype("int64")
        agg["pid"] = _os.getpid()
        yield agg.astype("int64")

    events = spark.range(n_events).select(
        ((F.col("id") * 7919) % n_keys).alias("key"), ((F.col("id") * 31) % 1000).alias("value")
    )
    out = events.repartition(partitions, "key").mapInPandas(
        fold, "key long, count long, sum long, key_group long, pid long"
    )
    rows = out.collect()
    return {
        "rows": [[r.key, r["count"], r["sum"], r.key_group] for r in rows],
        "pids": sorted({r.pid for r in rows}),
        "driver_python_pid": os.getpid(),
    }


def raises_on_executor(spark) -> None:
    """A job whose task fails on purpose: the error must come back to the caller, not hang the driver."""

    def boom(_rows):
        raise ValueError("deliberate failure in a task")

    spark.sparkContext.parallelize(range(2), 2).mapPartitions(boom).collect()


def test_cluster_started_with_two_executors(cluster: ClusterDriver):
    assert cluster.info["ok"]
    assert len(cluster.info["executors"]) >= 2, cluster.info
    assert cluster.info["pid"] != os.getpid()


def test_tasks_run_in_separate_executor_processes(cluster: ClusterDriver):
    r = cluster.call(task_processes, tasks=8)
    tasks = r["tasks"]
    assert len(tasks) == 8
    executor_ids = {t["executor_id"] for t in tasks}
    jvm_pids = {t["jvm_pid"] for t in tasks}
    python_pids = {t["python_pid"] for t in tasks}
    # every task ran under an executor JVM (found by its command line), at least two of them
    assert None not in executor_ids and None not in jvm_pids, tasks
    assert len(executor_ids) >= 2, tasks
    assert len(jvm_pids) >= 2, tasks
    # none of them is the driver: neither its JVM nor its Python process, nor this pytest process
    assert r["driver_jvm_pid"] not in jvm_pids
    assert r["driver_python_pid"] not in python_pids
    assert os.getpid() not in python_pids
    assert r["driver_python_pid"] == cluster.info["pid"]
    # one executor id per JVM: the ids name processes, not threads of one process
    by_id: dict[str, set[int]] = {}
    for t in tasks:
        by_id.setdefault(t["executor_id"], set()).add(t["jvm_pid"])
    assert all(len(pids) == 1 for pids in by_id.values()), by_id


def test_keyed_computation_on_cluster(cluster: ClusterDriver):
    import keygroups as kg

    n_events, n_keys = 20_000, 500
    r = cluster.call(keyed_count_sum, n_events=n_events, n_keys=n_keys, partitions=4)
    expected: dict[int, list[int]] = {}
    for i in range(n_events):
        acc = expected.setdefault((i * 7919) % n_keys, [0, 0])
        acc[0] += 1
        acc[1] += (i * 31) % 1000
    got_keys = Counter(row[0] for row in r["rows"])
    assert all(c == 1 for c in got_keys.values()), "a key was folded in two partitions"
    got = {row[0]: [row[1], row[2]] for row in r["rows"]}
    assert got == expected
    # the compiled key-group kernel gives the same answer in the executors as here
    assert all(row[3] == kg.assign_to_key_group(row[0], MAX_PARALLELISM) for row in r["rows"])
    assert len(r["pids"]) >= 2 and r["driver_python_pid"] not in r["pids"]


def test_task_failure_is_reported(cluster: ClusterDriver):
    with pytest.raises(ClusterCallError, match="deliberate failure in a task"):
        cluster.call(raises_on_executor)
    # the driver survives a failed job
    assert len(cluster.call(task_processes, tasks=2, seconds_per_task=0.0)["tasks"]) == 2


def test_only_module_level_functions_can_be_called(cluster: ClusterDriver):
    with pytest.raises(TypeError, match="module-level function"):
        cluster.call(lambda spark: 1)
