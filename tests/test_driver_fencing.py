"""Driver fencing without Spark: the newest driver's claim on a checkpoint location wins, an older driver is refused
before it plans and again right before it commits, and a refused commit leaves nothing of its batch behind."""

from __future__ import annotations

import os
import pickle
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import keygroups as kg
from keygroups.checkpoint import CheckpointStorage
from keygroups.errors import ConcurrentCommitError, DriverFencedError
from keygroups.runtime import DriverFence, begin_batch, commit_batch
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.runtime.subtask import run_keyed_subtask
from keygroups.serializers import Int64Serializer
from keygroups.state import ValueStateDescriptor

MAXP = 16
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])
OUT = pa.schema([("k", pa.int64()), ("total", pa.int64())])


class Total(KeyedProcessFunction):
    def open(self, ctx):
        self.total = ctx.get_state(ValueStateDescriptor("total", Int64Serializer()))

    def process_element(self, row, ctx):
        t = (self.total.value() or 0) + row["v"]
        self.total.update(t)
        return [{"k": row["k"], "total": t}]


def run_subtasks(plan, table):
    """Every subtask of ``plan`` over its share of ``table``; their reports."""
    spec = plan.keyed_task(key_columns=("k",), function=pickle.dumps(Total()), input_schema=SCHEMA,
                           output_schema=OUT)
    owners = kg.operator_index_for_key_group(MAXP, plan.parallelism,
                                             kg.assign_key_groups(table.column("k"), MAXP))
    return [run_keyed_subtask(spec, i, table.filter(pa.array(owners == i)).to_batches())
            for i in range(plan.parallelism)]


def batch(keys, v=1):
    return pa.table({"k": pa.array(keys, pa.int64()), "v": pa.array([v] * len(keys), pa.int64())})


def outputs(storage, metadata):
    """The committed output records of a checkpoint, sorted."""
    rows = []
    for f in metadata.outputs:
        rows += [tuple(r.values()) for r in pq.read_table(storage.url(f)).to_pylist()]
    return sorted(rows)


def test_a_newer_driver_fences_the_older_one_before_it_plans_and_before_it_commits(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "chk"))
    old = DriverFence.claim(storage, "totals")
    plan = begin_batch(storage, job_name="totals", max_parallelism=MAXP, parallelism=2, fence=old)
    commit_batch(plan, run_subtasks(plan, batch([1, 2, 3])))

    # the old driver plans its next batch, then a new driver starts and commits first
    stale = begin_batch(storage, job_name="totals", max_parallelism=MAXP, parallelism=2, fence=old)
    stale_reports = run_subtasks(stale, batch([1, 2, 3], v=100))
    new = DriverFence.claim(storage, "totals")
    assert new.epoch == old.epoch + 1
    with pytest.raises(DriverFencedError, match=rf"fencing token {old.epoch}\) was fenced.*token {new.epoch} "
                                                rf"\(job='totals', host=.*pid={os.getpid()}"):
        commit_batch(stale, stale_reports)
    # nothing of the refused batch is left: no chk-2, no shared file written for checkpoint 2
    assert storage.checkpoint_ids() == [1]
    assert not [f for f in storage.shared_files() if "-2-" in f.rsplit("/", 1)[1]]
    assert not os.path.exists(tmp_path / "chk" / "chk-2") or not os.listdir(tmp_path / "chk" / "chk-2")
    with pytest.raises(DriverFencedError):
        begin_batch(storage, job_name="totals", max_parallelism=MAXP, parallelism=2, fence=old)
    # the fence is a ConcurrentCommitError too: callers that handle a lost commit handle this alike
    assert issubclass(DriverFencedError, ConcurrentCommitError)

    plan = begin_batch(storage, job_name="totals", max_parallelism=MAXP, parallelism=3, fence=new)
    assert plan.checkpoint_id == 2
    last = commit_batch(plan, run_subtasks(plan, batch([1, 4])))
    assert outputs(storage, last) == [(1, 2), (4, 1)]   # the fenced batch's +100 was never applied


def test_racing_claims_are_contiguous_and_exactly_one_is_current(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "chk"))
    barrier = threading.Barrier(6)
    fences: list[DriverFence] = []

    def claim():
        barrier.wait()
        fences.append(DriverFence.claim(CheckpointStorage(str(tmp_path / "chk")), "job"))

    threads = [threading.Thread(target=claim) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(f.epoch for f in fences) == [1, 2, 3, 4, 5, 6]
    current = []
    for f in fences:
        try:
            f.check()
            current.append(f.epoch)
        except DriverFencedError:
            pass
    assert current == [6]


def test_fencing_works_on_an_fsspec_location():
    storage = CheckpointStorage("memory://fencing-test/chk")
    a = DriverFence.claim(storage, "j")
    a.check()
    b = DriverFence.claim(storage, "j")
    b.check()
    with pytest.raises(DriverFencedError, match="was fenced"):
        a.check()
