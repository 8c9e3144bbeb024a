"""The keyed stage's partitions carry the subtasks in an interleaved order (``subtask_order``): the tasks Spark runs
together after a rescale up reach different warm Python workers (issue 32). The order is a permutation, its inverse
exact, the identity where every task runs at once; on Spark a job rescaled 2 -> 4 -> 3 -> 2 gives exactly what the
unpermuted order gives, and each subtask ran in the partition the order says."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark import TaskContext, cloudpickle

import keygroups as kg
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.serializers import Int64Serializer
from keygroups.spark import KeyedJob
from keygroups.spark.executor import inverse_order, subtask_order, task_slots
from keygroups.state import ValueStateDescriptor
from state_views import latest_values

# The function below lives in this test file, which Spark's Python workers cannot import: ship it by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

MAX_PARALLELISM = 32
TOTAL = ValueStateDescriptor("total", Int64Serializer())
OUTPUT = "k long, total long, subtask int, partition int"


class WhereTotal(KeyedProcessFunction):
    """Per record the key's running total, with the subtask that ran it and the Spark partition its task read (the
    job does not forward, so every subtask runs in its own task)."""

    def open(self, context):
        self.total = context.get_state(TOTAL)
        self.subtask = context.subtask_index
        self.partition = TaskContext.get().partitionId()

    def process_element(self, record, context):
        total = (self.total.value() or 0) + record["v"]
        self.total.update(total)
        return [(context.current_key, total, self.subtask, self.partition)]


# ---- the order -----------------------------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(st.integers(1, 2048), st.one_of(st.none(), st.integers(0, 300)))
def test_the_order_is_a_permutation_with_an_exact_inverse(parallelism, slots):
    order = subtask_order(parallelism, slots)
    assert sorted(order) == list(range(parallelism))
    partitions = inverse_order(order)
    assert [partitions[s] for s in order] == list(range(parallelism))
    assert [order[p] for p in partitions] == list(range(parallelism))
    if slots is None or slots < 2 or parallelism <= slots:   # every task at once (or one at a time): as before
        assert order == tuple(range(parallelism))


@settings(max_examples=200, deadline=None)
@given(st.integers(2, 64), st.integers(2, 1024))
def test_each_wave_of_slots_tasks_spreads_over_the_key_range(slots, parallelism):
    """The tasks Spark starts together (``slots`` consecutive partitions) carry subtasks from different contiguous
    runs of the ``slots`` runs the subtasks split into, so subtasks that came out of one old subtask's range (held
    by one worker) do not run back to back in that worker."""
    order = subtask_order(parallelism, slots)
    run = [0] * parallelism
    for k in range(slots):
        for s in range(parallelism * k // slots, parallelism * (k + 1) // slots):
            run[s] = k
    for start in range(0, parallelism, slots):
        wave = [run[s] for s in order[start:start + slots]]
        assert len(set(wave)) == len(wave)


def test_the_orders_on_two_slots():
    assert subtask_order(4, 2) == (0, 2, 1, 3)   # 2 -> 4: old subtask 0's range is new subtasks 0 and 1
    assert subtask_order(3, 2) == (0, 1, 2)      # 2 <-> 3 stays as it was
    assert subtask_order(2, 2) == (0, 1)
    assert subtask_order(8, 2) == (0, 4, 1, 5, 2, 6, 3, 7)
    assert subtask_order(8, 4) == (0, 2, 4, 6, 1, 3, 5, 7)
    assert inverse_order((0, 2, 1, 3)) == (0, 2, 1, 3)
    assert inverse_order((2, 0, 1)) == (1, 2, 0)


# ---- on Spark ------------------------------------------------------------------------------------------------------

def _batches():
    """Four batches (p = 2, 4, 3, 2) of 40 keys, several records per key (ordered by ``seq``), and a fifth (p = 4)
    whose records all belong to one subtask, so the other three run idle."""
    out, seq = [], 0
    for b in range(4):
        rows = []
        for k in range(40):
            for r in range(1 + (k + b) % 3):
                rows.append((k, 10 ** b * (r + 1) + k, seq))
                seq += 1
        out.append(rows)
    one = [k for k in range(40) if kg.assign_to_key_group(k, MAX_PARALLELISM, "long") < MAX_PARALLELISM // 4]
    out.append([(k, 7, seq + i) for i, k in enumerate(one)])
    return out


def _run(spark, location, *, unpermuted):
    job = KeyedJob("order", "k", WhereTotal(), output_schema=OUTPUT, max_parallelism=MAX_PARALLELISM,
                   checkpoint_location=location, order_by="seq", forward_to_warm_process=False)
    if unpermuted:
        job._plans.slots = 1   # one task slot: the identity order, partition i carrying subtask i as before
    outputs, reports = [], []
    for rows, p in zip(_batches(), [2, 4, 3, 2, 4]):
        result = job.run_batch(spark.createDataFrame(rows, "k long, v long, seq long"), parallelism=p)
        outputs.append((p, sorted(tuple(r) for r in result.output.collect())))
        reports.append((p, [(r.subtask, r.key_group_range) for r in result.reports]))
    return outputs, reports


def _state(location):
    """Every key's total in the latest checkpoint, restored into one heap backend over all key groups."""
    return latest_values(location, TOTAL, MAX_PARALLELISM, "long")


@pytest.mark.spark
def test_a_job_rescaled_2_4_3_2_gives_what_the_unpermuted_order_gives(spark, tmp_path):
    assert task_slots(spark) == 2   # the test session: local[2, 2]
    permuted, permuted_reports = _run(spark, str(tmp_path / "permuted"), unpermuted=False)
    plain, plain_reports = _run(spark, str(tmp_path / "plain"), unpermuted=True)

    # the same results and state: (key, total) per record, and every key's total at the end
    def results(outputs):
        return [sorted((k, total) for k, total, _, _ in rows) for _, rows in outputs]

    assert results(permuted) == results(plain)
    state = _state(str(tmp_path / "permuted"))
    assert state == _state(str(tmp_path / "plain"))
    expected = {}
    for rows in _batches():
        for k, v, _ in rows:
            expected[k] = expected.get(k, 0) + v
    assert state == expected

    # every subtask reported its own range, idle ones included (the last batch: three of four subtasks idle)
    for p, reports in permuted_reports:
        assert sorted(reports) == [(i, kg.key_group_range(MAX_PARALLELISM, p, i)) for i in range(p)]
    assert sorted(permuted_reports[-1][1]) == sorted(plain_reports[-1][1])

    # each record ran in its key's subtask, in the partition the order gives it (p = 4: subtasks 1 and 2 swapped)
    for (p, rows), (_, plain_rows) in zip(permuted, plain):
        partitions = inverse_order(subtask_order(p, 2))
        for k, _, subtask, partition in rows:
            assert kg.assign_to_key_group(k, MAX_PARALLELISM, "long") in kg.key_group_range(MAX_PARALLELISM, p,
                                                                                               subtask)
            assert partition == partitions[subtask]
        assert all(partition == subtask for _, _, subtask, partition in plain_rows)
    moved = {(subtask, partition) for p, rows in permuted if p == 4 for _, _, subtask, partition in rows}
    assert {(1, 2), (2, 1)} <= moved
