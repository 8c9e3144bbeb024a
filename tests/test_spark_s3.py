"""The job runner with its checkpoints on a real S3 store (SeaweedFS on 127.0.0.1, see s3_server.py), which Spark's
own Parquet reader cannot reach (no S3A connector in pip's pyspark): outputs, replays and staged source input are
read through the checkpoint storage, on local[2] and on a multi-process local-cluster deployment resumed at other
parallelisms; on local paths Spark's reader stays, and both readers give the same rows."""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pyspark import cloudpickle
from pyspark.sql.pandas.types import from_arrow_schema

from keygroups.checkpoint import CheckpointStorage
from keygroups.cli import main as keygroups_main
from keygroups.spark import KeyedJob, read_checkpoint_files
from test_spark_job import TOTALS, EchoTimes, RunningTotal

pytestmark = pytest.mark.spark
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_outputs_and_replays_are_read_from_s3_across_rescales(spark, s3_server):
    job = KeyedJob("totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=32,
                   checkpoint_location=s3_server.url(), storage_options=s3_server.storage_options)
    batches = [[(k, 1) for k in range(20)], [(k, 10) for k in range(0, 20, 2)], [(k, 100) for k in range(20)]]
    frames = [spark.createDataFrame(rows, "k long, v long") for rows in batches]
    results = [job.run_batch(df, parallelism=p, checkpoint_id=i) for i, (df, p) in enumerate(zip(frames, [3, 1, 7]))]
    out = [sorted(map(tuple, r.output.collect())) for r in results]
    assert out == [[(k, 1, 0) for k in range(20)], [(k, 11, 1) for k in range(0, 20, 2)],
                   [(k, 111 if k % 2 == 0 else 101, 2) for k in range(20)]]
    for r in results:
        assert r.output.schema == from_arrow_schema(TOTALS)
        assert r.output.inputFiles() == []      # Spark's reader lists its files; the storage reader runs tasks
        assert sorted(map(tuple, r.output.collect())) == sorted(map(tuple, r.output.collect()))   # re-read alike
    replayed = job.run_batch(frames[0], parallelism=4, checkpoint_id=0)
    assert replayed.replayed and sorted(map(tuple, replayed.output.collect())) == out[0]
    assert job.storage.checkpoint_ids() == [0, 1, 2]
    # an idle subtask writes an empty output file: a batch of one key at p=7 still reads back as that one row
    one = job.run_batch(spark.createDataFrame([(3, 1)], "k long, v long"), parallelism=7, checkpoint_id=3)
    assert len(one.metadata.outputs) == 7 and [tuple(r) for r in one.output.collect()] == [(3, 102, 3)]


def test_timestamps_and_dates_come_back_from_s3_as_they_went_in(spark, s3_server):
    rows = [(1, dt.datetime(2026, 3, 29, 1, 30, 5, 123456), dt.date(2026, 3, 29)),
            (2, dt.datetime(1969, 12, 31, 23, 59, 59), dt.date(1900, 1, 1)), (3, None, None)]
    df = spark.createDataFrame(rows, "k long, ts timestamp, day date")
    job = KeyedJob("times", "k", EchoTimes(), output_schema="k long, ts timestamp, day date", max_parallelism=8,
                   checkpoint_location=s3_server.url(), storage_options=s3_server.storage_options)
    output = job.run_batch(df, parallelism=2).output
    assert output.schema == df.schema
    assert sorted(tuple(r) for r in output.collect()) == sorted(tuple(r) for r in df.collect())


SCHEMA = pa.schema([("user", pa.string()), ("n", pa.int64()), ("ts", pa.timestamp("us", tz="UTC")),
                    ("x", pa.float64())])


def test_both_readers_give_the_same_rows_and_auto_keeps_spark_on_local_paths(spark, tmp_path):
    storage = CheckpointStorage(str(tmp_path / "chk"))
    files = []
    for i, n in enumerate([5, 0, 3]):           # an idle subtask's output file has no rows
        table = pa.table({"user": [f"u{i}-{j}" for j in range(n)], "n": list(range(n)),
                          "ts": [dt.datetime(2026, 1, 1, j, tzinfo=dt.timezone.utc) for j in range(n)],
                          "x": [None if j == 0 else j / 2 for j in range(n)]}, schema=SCHEMA)
        files.append(storage.new_file(1, f"output-{i}") + ".parquet")
        with storage.open_write(files[-1]) as f:
            pq.write_table(table, f)
    frames = {r: read_checkpoint_files(spark, storage, files, SCHEMA, reader=r) for r in ("auto", "spark", "storage")}
    rows = {r: sorted(map(tuple, df.collect())) for r, df in frames.items()}
    assert len(rows["spark"]) == 8 and rows["auto"] == rows["spark"] == rows["storage"]
    assert all(df.schema == from_arrow_schema(SCHEMA) for df in frames.values())
    assert len(frames["auto"].inputFiles()) == 3 and frames["storage"].inputFiles() == []
    empty = read_checkpoint_files(spark, storage, [], SCHEMA)
    assert empty.schema == from_arrow_schema(SCHEMA) and empty.collect() == []
    with pytest.raises(ValueError, match="reader must be 'auto', 'spark' or 'storage', got 'hadoop'"):
        read_checkpoint_files(spark, storage, files, SCHEMA, reader="hadoop")


@pytest.mark.cluster
def test_demo_on_a_multi_process_cluster_with_checkpoints_on_s3(s3_server, capsys):
    """The main job: two executors in their own JVMs and Python workers, checkpoints on S3 only (the event log is
    local, which local-cluster's executors share), resumed 2 -> 1 -> 4, checked against the reference. Credentials
    come from the environment, as s3fs reads them in every process (executors inherit the driver's)."""
    url = s3_server.url()
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable,
           "AWS_ENDPOINT_URL": s3_server.endpoint_url, "AWS_ACCESS_KEY_ID": s3_server.key,
           "AWS_SECRET_ACCESS_KEY": s3_server.secret, "AWS_DEFAULT_REGION": "us-east-1"}
    result = subprocess.run(
        [sys.executable, "-m", "keygroups", "demo", "--master", "local-cluster[2,1,1024]", "--events", "6000",
         "--users", "500", "--partitions", "4", "--phases", "2,1,4", "--batches-per-phase", "1",
         "--max-parallelism", "16", "--dir", url],
        capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    out = result.stdout
    assert "running on Spark (local-cluster[2,1,1024])" in out and f"checkpoints in {url}/checkpoints" in out
    assert "phase 2 p=1 batch 1: chk-2" in out and "restore at the start of phase 3 (p=4)" in out
    assert "OK: all" in out and "orders equal the reference" in out
    fs, root = s3_server.filesystem(), url.removeprefix("s3://")
    fs.invalidate_cache()
    assert fs.exists(f"{root}/checkpoints/chk-3/_metadata")
    # the checkpoint it left, read with explicit options this time
    options = [a for k, v in s3_server.storage_options.items() if k != "client_kwargs"
               for a in ("--storage-option", f"{k}={v}")]
    capsys.readouterr()
    assert keygroups_main(["verify", f"{url}/checkpoints", *options]) == 0
    checked = capsys.readouterr().out
    verdict = checked.rstrip().splitlines()[-1]   # after the source positions the checkpoint holds
    assert verdict.startswith("checkpoint 3: ") and verdict.endswith(" files read, 0 corrupt or missing")
    fs.rm(root, recursive=True)
