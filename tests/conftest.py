"""Shared fixtures. Spark runs in local mode, one session for the whole test run; a Spark Connect session served by
that session's JVM is started the first time a test asks for one (fixtures ``connect`` and ``any_spark``)."""

from __future__ import annotations

import json
import os
import pathlib
import sys

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, settings

from jvm_options import use_for_spark

# Wall-clock deadlines make property tests flaky on a shared 2-core machine; speed is measured in benchmarks/.
settings.register_profile("keygroups", deadline=None, suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.load_profile("keygroups")

# the session fixtures `s3_server` (a SeaweedFS S3 endpoint on 127.0.0.1), `chromium` (a headless browser), and
# `shipped_environment` and `api_reference_build` (builds started in the background when collection ends; test
# modules add their own end-to-end runs with background.background_fixture)
pytest_plugins = ["s3_server", "browser", "background"]

DATA = pathlib.Path(__file__).parent / "data"

use_for_spark()   # before any test starts a JVM: the serial collector and C1 only (see jvm_options)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``--numprocesses=auto`` (pyproject's default): a worker per core and one more, at most four. Much of a run
    waits on JVMs, servers and subprocesses, so one worker more than cores keeps them busier. Each worker has its own
    Spark session (a JVM of up to 2 GiB); the modules of a file stay on one worker (``--dist=loadfile``), so that a
    module's fixtures start once. ``-n 0`` runs in this process. (Four workers on 2 cores were tried: 1,470-1,895 s
    for the whole suite against 1,603-1,792 s with three on the same shared machine, no clear gain.)"""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(cores + 1, 4))


def load_jsonl(name: str) -> list[dict]:
    with open(DATA / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")
def spark():
    """One local[2] SparkSession per test run (starting one costs seconds)."""
    pyspark_sql = pytest.importorskip("pyspark.sql")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    session = (
        pyspark_sql.SparkSession.builder.master("local[2,2]")  # 2 cores; a failed task is retried once
        .appName("keygroups-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.default.parallelism", "4")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.driver.memory", "2g")
        .config("spark.sql.session.timeZone", "UTC")
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def connect_server(spark):
    """A Spark Connect session served by the classic session's JVM (one per test run, started on first use). Use the
    fixture ``connect``: it switches pyspark.sql.functions to Connect Columns for the test."""
    from keygroups.spark.local_connect import connect_mode, local_connect_session, stop_local_connect

    with connect_mode(False):   # the other tests of the run go on with classic Columns
        session = local_connect_session(spark)
    yield session
    with connect_mode(True):
        session.stop()
    stop_local_connect(spark)


@pytest.fixture
def connect(connect_server):
    """The Spark Connect session, with pyspark.sql.functions building Connect Columns during the test (PySpark
    chooses per process; the classic tests of the same run get classic ones back afterwards)."""
    from keygroups.spark.local_connect import connect_mode

    with connect_mode(True):
        yield connect_server


@pytest.fixture(params=["classic", "connect"])
def any_spark(request):
    """The test runs twice: on the classic session and over Spark Connect. To run only some cases on both, choose
    the session per case: ``@pytest.mark.parametrize(("any_spark", ...), [("connect", ...), ...],
    indirect=["any_spark"])``."""
    return request.getfixturevalue("spark" if request.param == "classic" else "connect")


def is_connect(session) -> bool:
    """Whether ``session`` is a Spark Connect session (no py4j gateway, no SparkContext, no RDDs)."""
    return getattr(session, "_jvm", None) is None


def partition_count(df) -> int:
    """How many partitions ``df`` has, on either session type. Connect has no ``df.rdd``: there, one task per
    partition (empty ones too) returns one row, and the rows are counted. Not for a query that may be empty as a
    whole: Spark then runs no tasks at all (it drops the partitions of a shuffle it finds empty at run time)."""
    if not is_connect(df.sparkSession):
        return df.rdd.getNumPartitions()
    def one_row_per_partition(batches):   # nested: cloudpickle ships it by value (workers cannot import conftest)
        for _ in batches:
            pass
        yield pa.RecordBatch.from_pylist([{"n": 1}], schema=pa.schema([("n", pa.int32())]))

    return df.mapInArrow(one_row_per_partition, "n int").count()
