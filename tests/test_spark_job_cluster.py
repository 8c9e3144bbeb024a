"""The main job on a real multi-process Spark deployment (local-cluster: a master and two executors, each its own
JVM with its own Python workers), resumed at other parallelisms and checked against the reference. Nothing may
depend on the driver's memory or on executors sharing a process: state travels only through the checkpoint
directory."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.cluster]


def test_demo_with_rescales_on_a_multi_process_cluster(tmp_path):
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable}
    result = subprocess.run(
        [sys.executable, "-m", "keygroups", "demo", "--master", "local-cluster[2,1,1024]", "--events", "6000",
         "--users", "500", "--partitions", "4", "--phases", "2,1,4", "--batches-per-phase", "1",
         "--max-parallelism", "16", "--dir", str(tmp_path)],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    assert "running on Spark (local-cluster[2,1,1024])" in result.stdout
    assert "restore at the start of phase 3 (p=4)" in result.stdout
    assert "OK: all" in result.stdout
