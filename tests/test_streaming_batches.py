"""Structured Streaming batch ids and checkpoint ids, without Spark: the driver (``begin_batch(streaming=...)``)
maps each ``foreachBatch`` batch to a checkpoint, continuing a savepoint or a location's checkpoints from any first
batch id, and finding its place again when a query restarts (a replay maps to the checkpoint that committed it).
The streaming query itself runs in test_spark_job.py (classic and Spark Connect)."""

from __future__ import annotations

import pickle

import pyarrow as pa
import pytest

from keygroups.checkpoint import CheckpointStorage
from keygroups.errors import KeyGroupsError
from keygroups.runtime import KeyedProcessFunction, begin_batch, commit_batch
from keygroups.runtime.driver import StreamingBatch
from keygroups.runtime.state_writer import commit_savepoint, plan_savepoint, write_savepoint_subtask
from keygroups.runtime.subtask import run_keyed_subtask

MAX_PARALLELISM = 8
SCHEMA = pa.schema([("k", pa.int64()), ("v", pa.int64())])


class Nothing(KeyedProcessFunction):
    def process_element(self, record, context):
        return None


def _batch(storage: CheckpointStorage, batch: StreamingBatch, *, savepoint: str | None = None) -> int:
    """One empty batch as ``foreach_batch`` runs it: returns its checkpoint id (negative: a replay of that one)."""
    plan = begin_batch(storage, job_name="s", max_parallelism=MAX_PARALLELISM, parallelism=1, savepoint=savepoint,
                       streaming=batch)
    if plan.replay is not None:
        return -plan.replay.checkpoint_id
    spec = plan.keyed_task(key_columns=("k",), function=pickle.dumps(Nothing()), input_schema=SCHEMA,
                           output_schema=SCHEMA, warm_heap_backends=0)
    return commit_batch(plan, [run_keyed_subtask(spec, 0, [])]).checkpoint_id


def _savepoint(location: str, name: str) -> None:
    """A savepoint as ``write_savepoint`` bootstraps one (checkpoint id 0), in ``location``."""
    plan = plan_savepoint(SCHEMA, location, name, key_columns="k", states={"v": "v"},
                          max_parallelism=MAX_PARALLELISM, parallelism=1)
    commit_savepoint(plan, [write_savepoint_subtask(plan, 0, pa.table({"k": [1], "v": [5]}).to_batches())])


def test_on_a_new_location_the_checkpoint_id_is_the_batch_id(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "c"))
    q = "q-1"
    assert [_batch(storage, StreamingBatch(b, q)) for b in (0, 1, 2)] == [0, 1, 2]
    assert _batch(storage, StreamingBatch(2, q)) == -2     # Spark replays its last batch: nothing runs again
    assert _batch(storage, StreamingBatch(3, q)) == 3
    assert storage.load(3).properties["streaming_batch"] == {"query": q, "batch_id": 3}


@pytest.mark.parametrize("query", ["q-1", None])
def test_a_query_continues_a_savepoint_from_batch_0(tmp_path, query):
    location = str(tmp_path / "c")
    _savepoint(location, "boot")   # checkpoint id 0, as write_savepoint and `keygroups flink import` write
    storage = CheckpointStorage(location)
    assert _batch(storage, StreamingBatch(0, query), savepoint="boot") == 1
    assert _batch(storage, StreamingBatch(1, query)) == 2
    assert _batch(storage, StreamingBatch(1, query)) == -2   # the query restarted: batch 1 replays checkpoint 2
    assert _batch(storage, StreamingBatch(2, query)) == 3


def test_a_query_continues_a_savepoint_from_any_first_batch_id(tmp_path):
    location = str(tmp_path / "c")
    _savepoint(location, "boot")
    storage = CheckpointStorage(location)
    assert _batch(storage, StreamingBatch(7, "q"), savepoint="boot") == 7   # above the savepoint: the batch id
    assert _batch(storage, StreamingBatch(8, "q")) == 8


def test_a_new_query_on_a_location_with_checkpoints_numbers_on_from_the_newest(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "c"))
    assert [_batch(storage, StreamingBatch(b, "old")) for b in (0, 1, 2)] == [0, 1, 2]
    # a new Spark checkpoint: a new query id, batch ids from 0 again: new batches, never replays of the old ones
    assert [_batch(storage, StreamingBatch(b, "new")) for b in (0, 1)] == [3, 4]
    assert _batch(storage, StreamingBatch(1, "new")) == -4
    assert _batch(storage, StreamingBatch(0, "new")) == -3   # still retained (3 by default)


def test_without_query_ids_a_batch_continues_the_latest_when_it_is_its_batch_or_the_next(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "c"))
    assert [_batch(storage, StreamingBatch(b)) for b in (0, 1, 2)] == [0, 1, 2]
    assert _batch(storage, StreamingBatch(2)) == -2          # a replay
    assert _batch(storage, StreamingBatch(3)) == 3           # the next batch
    assert _batch(storage, StreamingBatch(0)) == 4           # a new query: numbered on from the newest
    assert _batch(storage, StreamingBatch(1)) == 5
    # a query id on one side only (one query run over classic Spark, then over Connect): the same rule
    assert _batch(storage, StreamingBatch(2, "q")) == 6
    assert _batch(storage, StreamingBatch(2)) == -6
    assert _batch(storage, StreamingBatch(3)) == 7
    assert _batch(storage, StreamingBatch(4, "q")) == 8


def test_checkpoints_written_before_batches_were_recorded_replay_by_their_id(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "c"))
    plan = begin_batch(storage, job_name="s", max_parallelism=MAX_PARALLELISM, parallelism=1, checkpoint_id=4)
    spec = plan.keyed_task(key_columns=("k",), function=pickle.dumps(Nothing()), input_schema=SCHEMA,
                           output_schema=SCHEMA, warm_heap_backends=0)
    commit_batch(plan, [run_keyed_subtask(spec, 0, [])])
    assert _batch(storage, StreamingBatch(4, "q")) == -4   # the old mapping: checkpoint id = batch id
    assert _batch(storage, StreamingBatch(5, "q")) == 5


def test_a_replay_gap_names_the_batch_the_checkpoint_and_what_is_retained(tmp_path):
    storage = CheckpointStorage(str(tmp_path / "c"), retain=1)
    _savepoint(storage.location, "boot")
    assert [_batch(storage, StreamingBatch(b, "q"), savepoint="boot" if b == 0 else None)
            for b in (0, 1, 2)] == [1, 2, 3]
    with pytest.raises(KeyGroupsError, match=r"^batch 0 of query q is checkpoint 1, which is older than the latest "
                                             r"complete checkpoint 3 \(batch 2 of query q\) and is no longer "
                                             r"retained \(retained: \[3\]\): it cannot be replayed$"):
        _batch(storage, StreamingBatch(0, "q"))


def test_an_explicit_id_at_or_below_a_restored_savepoint_is_refused_naming_it(tmp_path):
    location = str(tmp_path / "c")
    _savepoint(location, "boot")
    storage = CheckpointStorage(location)
    with pytest.raises(KeyGroupsError, match=r"^checkpoint 0 does not follow savepoint 'boot' \(checkpoint 0\), "
                                             r"which this batch restores: .* give an id above 0"):
        begin_batch(storage, job_name="s", max_parallelism=MAX_PARALLELISM, parallelism=1, savepoint="boot",
                    checkpoint_id=0)
    with pytest.raises(ValueError, match="give checkpoint_id or streaming, not both"):
        begin_batch(storage, job_name="s", max_parallelism=MAX_PARALLELISM, parallelism=1, checkpoint_id=1,
                    streaming=StreamingBatch(0))
