"""Warm heap state on a real local Spark session: Spark reuses its Python workers, so a heap backend kept after one
batch is resumed (or caught up) by the next; the job's results are exactly those of the same job restoring every
batch."""

from __future__ import annotations

import sys

import pyarrow as pa
import pytest
from pyspark import cloudpickle

from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.serializers import Int64Serializer
from keygroups.spark import KeyedJob
from keygroups.state import ValueStateDescriptor

pytestmark = pytest.mark.spark
cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Spark's workers cannot import this test file
MAX_PARALLELISM = 32
TOTALS = pa.schema([("k", pa.int64()), ("total", pa.int64()), ("batch", pa.int64())])


class RunningTotal(KeyedProcessFunction):
    """Per key the sum of its records' ``v``; a record with ``v == 0`` clears it."""

    def open(self, context):
        self.total = context.get_state(ValueStateDescriptor("total", Int64Serializer()))

    def process_element(self, record, context):
        if record["v"] == 0:
            self.total.clear()
            return [(context.current_key, 0, context.checkpoint_id)]
        total = (self.total.value() or 0) + record["v"]
        self.total.update(total)
        return [(context.current_key, total, context.checkpoint_id)]


def test_a_job_gives_the_same_results_with_warm_heap_state(spark, tmp_path):
    warm = KeyedJob("totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                    checkpoint_location=str(tmp_path / "warm"))
    cold = KeyedJob("totals", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                    checkpoint_location=str(tmp_path / "cold"), warm_heap_backends=0)
    batches = [([(k, 1) for k in range(60)], 2)]
    batches += [([(k, step) for k in range(step % 3, 60, 2)] + [(step, 0)], 2) for step in range(1, 6)]
    batches += [([(k, 7) for k in range(0, 60, 5)], 3), ([(k, 9) for k in range(60)], 3)]
    batches += [([(k, 11) for k in range(0, 60, 4)], 3) for _ in range(3)]
    expected: dict[int, int] = {}
    modes: dict[str, list[str]] = {"warm": [], "cold": []}
    for number, (rows, parallelism) in enumerate(batches, start=1):
        want = []
        for k, v in rows:
            expected[k] = 0 if v == 0 else expected.get(k, 0) + v
            want.append((k, expected[k], number))
        df = spark.createDataFrame(rows, "k long, v long")
        for name, job in (("warm", warm), ("cold", cold)):
            result = job.run_batch(df, parallelism=parallelism)
            assert sorted(tuple(r) for r in result.output.collect()) == sorted(want), (name, number)
            modes[name] += [r.restored.mode for r in result.reports]
    assert set(modes["cold"]) == {"new", "cold"}
    # Spark hands a subtask to either of its two Python workers: each keeps what it ran, warm or a few batches behind
    assert {"warm", "caught-up"} & set(modes["warm"]), modes["warm"]


PLACED = pa.schema([("k", pa.int64()), ("pid", pa.int64()), ("subtask", pa.int64())])


class WherePlaced(KeyedProcessFunction):
    """Counts per key, and says which Python worker process ran the record's subtask."""

    def open(self, context):
        self.count = context.get_state(ValueStateDescriptor("count", Int64Serializer()))

    def process_element(self, record, context):
        import os
        self.count.update((self.count.value() or 0) + 1)
        return [(context.current_key, os.getpid(), context.subtask_index)]


def test_a_rocksdb_subtask_resumes_its_database_in_whichever_worker_spark_picks(spark, tmp_path):
    """Steady batches at one parallelism. RocksDB keeps its database on the host's disk: warm in the worker that ran
    the subtask last batch (its decoded values and unwritten changes kept beside the database), and in any other
    worker warm or caught up (the database is written only every few snapshots: the worker catches it up from the
    blocks committed since), never cold. Spark's pool of idle workers (``PythonWorkerFactory.idleWorkers``, a FIFO
    queue refilled in task-completion order) places each task; RocksDB subtasks are never forwarded."""
    job = KeyedJob("placed", "k", WherePlaced(), output_schema=PLACED, max_parallelism=MAX_PARALLELISM,
                   checkpoint_location=str(tmp_path / "placed"), backend="rocksdb", local_dir=str(tmp_path / "local"))
    df = spark.createDataFrame([(k, 1) for k in range(40)], "k long, v long")
    held: dict[int, dict[int, int]] = {}   # pid -> subtask -> the last batch that process ran it in
    for number in range(1, 6):
        result = job.run_batch(df, parallelism=2)
        placed = {(r.subtask, r.pid) for r in result.output.select("subtask", "pid").distinct().collect()}
        assert len({s for s, _ in placed}) == len(placed) == 2, placed   # one process per subtask
        modes = {r.subtask: r.restored.mode for r in result.reports}
        assert all(r.forwarded_from is None for r in result.reports)
        for subtask, pid in sorted(placed):
            last = held.get(pid, {}).get(subtask)
            expected = {"new"} if number == 1 else {"warm"} if last == number - 1 else {"warm", "caught-up"}
            assert modes[subtask] in expected, (number, subtask, pid, held, modes)
        for subtask, pid in placed:
            held.setdefault(pid, {})[subtask] = number


def test_a_heap_subtask_runs_in_the_worker_that_holds_its_state_whichever_worker_spark_picks(spark, tmp_path):
    """Spark places each task on whichever of its Python workers is idle first, and a heap backend lives in the
    worker that ran its subtask: a task placed elsewhere sends its input to that worker, which runs the subtask
    (``keygroups.runtime.warm_exchange``). So every steady batch after the first resumes warm (nothing read), each
    range stays in one worker, and a rescale (2 -> 3, 3 -> 2) reads only the key groups that changed holder; the
    output is exactly a plain dict's."""
    job = KeyedJob("placed", "k", RunningTotal(), output_schema=TOTALS, max_parallelism=MAX_PARALLELISM,
                   checkpoint_location=str(tmp_path / "placed"))
    expected: dict[int, int] = {}
    runs_in: dict[tuple[int, int], int] = {}   # (parallelism, subtask) -> the pid that ran it
    forwarded = 0
    previous_p = None
    for number, p in enumerate([2, 2, 2, 2, 3, 3, 3, 2, 2], start=1):
        rows = [(k, number) for k in range(number % 4, 80, 3)]
        want = []
        for k, v in rows:
            expected[k] = expected.get(k, 0) + v
            want.append((k, expected[k], number))
        result = job.run_batch(spark.createDataFrame(rows, "k long, v long"), parallelism=p)
        assert sorted(tuple(r) for r in result.output.collect()) == sorted(want), number
        reports = result.reports
        forwarded += sum(r.forwarded_from is not None for r in reports)
        assert all(r.forwarded_from != r.process for r in reports)
        if number == 1:
            assert {r.restored.mode for r in reports} == {"new"}
        elif p == previous_p:   # steady: warm whatever worker Spark picked, always in the same one
            assert all(r.restored.mode == "warm" and r.restored.bytes_read == 0 for r in reports), reports
            for r in reports:
                assert runs_in.setdefault((p, r.subtask), r.process) == r.process, (number, r)
        else:   # a rescale: at most the key groups that changed holder are read (a piece parked by an earlier
            # rescale in the worker that takes them catches up instead: less)
            moved = result.report.assignment.moved_bytes
            read = sum(r.restored.bytes_read for r in reports)
            assert 0 < read <= moved, (number, read, moved)
            assert all(r.restored.mode in ("warm", "moved") for r in reports), reports
            runs_in = {(p, r.subtask): r.process for r in reports}
        previous_p = p
    assert forwarded > 0   # Spark did place some tasks away from their state (it does, about every other batch)
