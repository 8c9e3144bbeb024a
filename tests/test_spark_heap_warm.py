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


@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
def test_warm_state_is_lost_only_where_spark_moves_a_heap_subtask_to_another_worker(spark, tmp_path, backend):
    """Steady batches at one parallelism. Heap: a subtask resumes its state warm whenever Spark runs it in the Python
    worker that ran it last batch, caught up (reading only the blocks committed since) in one that ran it earlier, and
    restores it cold only in a worker that never held its range. Nothing of ours (the registry's bound, the restore
    point, the takeover) loses warm state; what varies between runs is only where Spark's pool of idle workers
    (``PythonWorkerFactory.idleWorkers``, a FIFO queue refilled in task-completion order) places each task. RocksDB
    keeps its database on the host's disk: warm in the worker that ran the subtask last batch (its decoded values and
    unwritten changes kept beside the database), and in any other worker warm or caught up (the database is written
    only every few snapshots: the worker catches it up from the blocks committed since), never cold."""
    job = KeyedJob("placed", "k", WherePlaced(), output_schema=PLACED, max_parallelism=MAX_PARALLELISM,
                   checkpoint_location=str(tmp_path / "placed"), backend=backend, local_dir=str(tmp_path / "local"))
    df = spark.createDataFrame([(k, 1) for k in range(40)], "k long, v long")
    held: dict[int, dict[int, int]] = {}   # pid -> subtask -> the last batch that process ran it in
    seen = []
    for number in range(1, 7):
        result = job.run_batch(df, parallelism=2)
        placed = {(r.subtask, r.pid) for r in result.output.select("subtask", "pid").distinct().collect()}
        assert len({s for s, _ in placed}) == len(placed) == 2, placed   # one process per subtask
        modes = {r.subtask: r.restored.mode for r in result.reports}
        for subtask, pid in sorted(placed):
            last = held.get(pid, {}).get(subtask)
            expected = ({"new"} if number == 1 else {"warm"} if last == number - 1
                        else {"warm", "caught-up"} if backend == "rocksdb" else {"caught-up"} if last else {"cold"})
            assert modes[subtask] in expected, (number, subtask, pid, held, modes)
            seen.append(modes[subtask])
        for subtask, pid in placed:
            held.setdefault(pid, {})[subtask] = number
    assert "warm" in seen or "caught-up" in seen, seen
