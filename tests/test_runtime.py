"""The subtask runtime end to end without Spark: source subtasks, key-group placement, keyed subtasks and the commit,
rescaled between batches, against the plain reference computation. (The same code runs inside Spark tasks; the
Spark runner is tested in test_spark_job.py.)"""

from __future__ import annotations

import io
import pickle

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import keygroups as kg
from keygroups.checkpoint import CheckpointStorage
from keygroups.cli import shop
from keygroups.errors import KeyGroupOutOfRangeError
from keygroups.runtime.commit import checkpoint_metadata
from keygroups.runtime.functions import KeyedProcessFunction
from keygroups.runtime.source import SourceTaskSpec, run_source_subtask, staged_schema
from keygroups.runtime.subtask import KeyedTaskSpec, create_backend, run_keyed_subtask
from keygroups.sources import write_partitioned_log

MAX_PARALLELISM = 64


class Boom(RuntimeError):
    pass


class FailingCart(shop.CartFunction):
    """Fails on one user's events (a task that dies mid-batch)."""

    def __init__(self, victim: str) -> None:
        self.victim = victim

    def process_element(self, event, context):
        if event["user"] == self.victim:
            raise Boom(f"task died while processing {self.victim}")
        return super().process_element(event, context)


@pytest.fixture
def events(tmp_path):
    partitions = shop.generate_events(3000, 150, partitions=5, seed=3)
    write_partitioned_log(tmp_path / "log", partitions)
    return partitions, str(tmp_path / "log")


def run_batch(location, log_dir, function, parallelism, max_records, *, retry_subtasks=False, backend="heap"):
    """One micro-batch as the Spark driver runs it, in this process."""
    storage = CheckpointStorage(location)
    previous = storage.latest()
    cid = previous.checkpoint_id + 1 if previous else 1
    restore_from = previous.checkpoint_id if previous else None
    sources = [
        run_source_subtask(SourceTaskSpec(log_dir, shop.EVENT_SCHEMA, parallelism, max_records, location, cid,
                                          restore_from), i)
        for i in range(parallelism)
    ]
    tables = [pq.read_table(io.BytesIO(storage.read_bytes(r["input_file"]))) for r in sources if r["input_file"]]
    schema = staged_schema(shop.EVENT_SCHEMA)
    staged = pa.concat_tables(tables) if tables else schema.empty_table()
    owners = kg.assign_operators(staged.column("user"), MAX_PARALLELISM, parallelism)
    spec = KeyedTaskSpec(
        job_name="carts", key_columns=("user",), key_type="string", function=pickle.dumps(function),
        input_schema=schema, output_schema=shop.ORDER_SCHEMA, max_parallelism=MAX_PARALLELISM,
        parallelism=parallelism, checkpoint_location=location, checkpoint_id=cid, restore_from=restore_from,
        order_columns=("_partition", "_offset"), backend=backend,
    )
    reports = []
    for i in range(parallelism):
        batches = staged.filter(pa.array(owners == i)).to_batches()
        if retry_subtasks:  # a first attempt that succeeded but whose report Spark discarded
            run_keyed_subtask(spec, i, batches)
        reports.append(run_keyed_subtask(spec, i, batches))
    metadata = checkpoint_metadata(job_name="carts", checkpoint_id=cid, max_parallelism=MAX_PARALLELISM,
                                   parallelism=parallelism, keyed_reports=reports, source_reports=sources)
    storage.commit(metadata)
    orders = [pq.read_table(io.BytesIO(storage.read_bytes(f))) for f in metadata.properties["outputs"]]
    return metadata, pa.concat_tables(orders), sum(r["records"] for r in sources)


def final_states(location):
    storage = CheckpointStorage(location)
    backend = create_backend("heap", kg.key_group_range(MAX_PARALLELISM, 1, 0), MAX_PARALLELISM, "string")
    backend.restore(storage, storage.latest())
    return dict(shop.read_user_states(backend))


def rows(table):
    return sorted(zip(*[table.column(n).to_pylist() for n in shop.ORDER_SCHEMA.names]))


def run_schedule(location, log_dir, schedule, **kwargs):
    orders, total = [], 0
    for parallelism, max_records in schedule:
        _, out, n = run_batch(location, log_dir, shop.CartFunction(), parallelism, max_records, **kwargs)
        orders += rows(out)
        total += n
    return sorted(orders), total


@pytest.mark.parametrize("backend", ["heap", "rocksdb"])
def test_rescaling_4_2_8_1_gives_exactly_the_reference(events, tmp_path, backend):
    partitions, log_dir = events
    expected_state, expected_orders = shop.reference(partitions)
    location = str(tmp_path / "chk")
    orders, total = run_schedule(location, log_dir, [(4, 200), (4, 150), (2, 400), (8, 60), (8, 100), (1, None)],
                                 backend=backend)
    assert total == 3000
    assert orders == sorted(expected_orders)
    assert final_states(location) == expected_state


def test_retried_subtasks_never_apply_a_batch_twice(events, tmp_path):
    partitions, log_dir = events
    expected_state, expected_orders = shop.reference(partitions)
    location = str(tmp_path / "chk")
    orders, _ = run_schedule(location, log_dir, [(3, 300), (5, 300), (2, None)], retry_subtasks=True)
    assert orders == sorted(expected_orders)
    assert final_states(location) == expected_state


def test_a_crashed_batch_leaves_the_previous_checkpoint_and_can_run_again(events, tmp_path):
    partitions, log_dir = events
    expected_state, expected_orders = shop.reference(partitions)
    location = str(tmp_path / "chk")
    orders, _ = run_schedule(location, log_dir, [(4, 250)])
    storage = CheckpointStorage(location)
    before = storage.latest()
    victim = next(iter(partitions[0]))["user"]
    with pytest.raises(Boom):
        run_batch(location, log_dir, FailingCart(victim), 2, None)
    assert storage.latest().checkpoint_id == before.checkpoint_id  # the half-run batch does not exist
    more, _ = run_schedule(location, log_dir, [(2, None)])  # the same batch, run again at another parallelism
    assert orders + more and sorted(orders + more) == sorted(expected_orders)
    assert final_states(location) == expected_state


def test_a_subtask_refuses_records_outside_its_key_groups(events, tmp_path):
    _, log_dir = events
    location = str(tmp_path / "chk")
    table = pa.table({"user": ["user-000001", "user-000002", "user-000003", "user-000004"]})
    groups = kg.assign_key_groups(table.column("user"), MAX_PARALLELISM)
    owner = kg.operator_index_for_key_group(MAX_PARALLELISM, 2, groups)
    spec = KeyedTaskSpec(job_name="x", key_columns=("user",), key_type="string",
                         function=pickle.dumps(shop.CartFunction()), input_schema=table.schema,
                         output_schema=shop.ORDER_SCHEMA, max_parallelism=MAX_PARALLELISM, parallelism=2,
                         checkpoint_location=location, checkpoint_id=1, restore_from=None)
    wrong = int(np.flatnonzero(owner == 1)[0])
    with pytest.raises(KeyGroupOutOfRangeError, match=r"subtask 0 of 2 owns key groups .* but received key"):
        run_keyed_subtask(spec, 0, table.slice(wrong, 1).to_batches())


class Counter(KeyedProcessFunction):
    """Vectorized form: one call per key with that key's records as an Arrow table."""

    def open(self, context):
        from keygroups.serializers import Int64Serializer
        from keygroups.state import ValueStateDescriptor

        self.count = context.get_state(ValueStateDescriptor("count", Int64Serializer()))

    def process_key_batch(self, key, records, context):
        total = (self.count.value() or 0) + records.num_rows
        self.count.update(total)
        return pa.table({"k": pa.array([key[0]], pa.int64()), "g": pa.array([key[1]], pa.int32()),
                         "n": pa.array([total], pa.int64())})


def test_vectorized_function_and_composite_int_keys(tmp_path):
    location = str(tmp_path / "chk")
    table = pa.table({"k": pa.array([1, 2, 1, 3, 1, 2], pa.int64()), "g": pa.array([7, 7, 7, 8, 7, 7], pa.int32())})
    key_type = ("long", "int")
    out_schema = pa.schema([("k", pa.int64()), ("g", pa.int32()), ("n", pa.int64())])
    owners = kg.operator_index_for_key_group(
        16, 3, kg.assign_key_groups_for_tuples([table.column("k"), table.column("g")], 16, key_type))
    results = []
    for cid, restore in ((1, None), (2, 1)):
        spec = KeyedTaskSpec(job_name="c", key_columns=("k", "g"), key_type=key_type, function=pickle.dumps(Counter()),
                             input_schema=table.schema, output_schema=out_schema, max_parallelism=16, parallelism=3,
                             checkpoint_location=location, checkpoint_id=cid, restore_from=restore)
        reports = [run_keyed_subtask(spec, i, table.filter(pa.array(owners == i)).to_batches()) for i in range(3)]
        metadata = checkpoint_metadata(job_name="c", checkpoint_id=cid, max_parallelism=16, parallelism=3,
                                       keyed_reports=reports)
        CheckpointStorage(location).commit(metadata)
        storage = CheckpointStorage(location)
        results.append(sorted(rows_of(pa.concat_tables(
            pq.read_table(io.BytesIO(storage.read_bytes(f))) for f in metadata.properties["outputs"]))))
    assert results[0] == [(1, 7, 3), (2, 7, 2), (3, 8, 1)]
    assert results[1] == [(1, 7, 6), (2, 7, 4), (3, 8, 2)]


def rows_of(table):
    return list(zip(*[c.to_pylist() for c in table.columns]))
