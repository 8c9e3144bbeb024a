"""The JVM options of every JVM the test suite starts: Spark's (drivers, local-cluster executors, ``spark-submit``)
through a ``spark-defaults.conf`` that conftest points ``SPARK_CONF_DIR`` at, and the Flink jobs of
``flink_harness``.

The serial collector and the C1 compiler only. The suite's JVMs live seconds to minutes, several at once on two cores,
where G1's concurrent threads and C2's compilations cost more CPU than they win back. Measured with three xdist
workers on 2 cores, the machine's CPU beside the wall time: the six largest Spark modules took 802 s of CPU (411 s
wall) with the JVM's defaults, 636 s (330 s) with the serial collector, 547 s (280 s) with both; seven modules of
Spark, Spark Connect, ``local-cluster`` and Flink jobs, runs interleaved, 585 and 649 s (298, 328 s) without, 470 and
389 s (243, 199 s) with. Neither changes what any test checks; users' JVMs keep Spark's defaults."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

JVM_OPTIONS = ("-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")


def use_for_spark() -> None:
    """Give every Spark JVM this process and its children start :data:`JVM_OPTIONS`, as Spark's *default* Java
    options (``spark.{driver,executor}.defaultJavaOptions``), so that a test's own ``extraJavaOptions`` still apply
    after them. A ``SPARK_CONF_DIR`` already set is the user's Spark configuration and is left alone."""
    if "SPARK_CONF_DIR" in os.environ:
        return
    conf_dir = tempfile.mkdtemp(prefix="keygroups-test-spark-conf-")
    options = " ".join(JVM_OPTIONS)
    with open(os.path.join(conf_dir, "spark-defaults.conf"), "w", encoding="utf-8") as f:
        f.write(f"spark.driver.defaultJavaOptions {options}\nspark.executor.defaultJavaOptions {options}\n")
    os.environ["SPARK_CONF_DIR"] = conf_dir
    atexit.register(shutil.rmtree, conf_dir, True)
